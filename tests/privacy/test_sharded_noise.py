"""Sharded noise (issue 49, FSDP2): the shards of a draw, put end to end, are exactly one process's draw.

Each "process" here is a `GaussianNoise` under the same test seed holding dim-0-style contiguous shards of the same
tensors, as FSDP2 lays them out (⌈n / world⌉ coordinates each, the last ones short or empty).
"""

from __future__ import annotations

import pytest
import torch

from hf_private.privacy import GaussianNoise, SecretRandom
from hf_private.privacy.rng import GaussianSampler
from hf_private.privacy.sharded_noise import ShardedGaussianSampler, TensorShard

SEED = 31
STD = 1.7
# empty, one value, odd, a whole chunk, chunks and a remainder (P = 4 pairs: chunks of 8 values), a large one
SIZES = [0, 1, 7, 8, 2 * 8 + 5, 33, 64]


def _noise(pairs: int | None) -> GaussianNoise:
    noise = GaussianNoise("cpu", test_seed=SEED)
    if pairs is not None:
        noise.sampler = GaussianSampler(noise.random, pairs_per_chunk=pairs)
    return noise


def _one_process(sizes: list[int], pairs: int | None) -> tuple[list[torch.Tensor], int]:
    noise = _noise(pairs)
    tensors = [torch.zeros(size) for size in sizes]
    noise.add_(tensors, STD)
    noise.add_([torch.zeros(3)], STD)  # a second release: the request counters must still agree
    return tensors, noise.random._requests


def _sharded(sizes: list[int], pairs: int | None, world: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each rank's shards of the same two releases; the shards put end to end, and each rank's request count."""
    parts: list[list[torch.Tensor]] = [[] for _ in sizes]
    requests = []
    for rank in range(world):
        noise = _noise(pairs)
        shards = []
        for size in sizes:
            per_rank = -(-size // world)
            start, end = min(rank * per_rank, size), min((rank + 1) * per_rank, size)
            shards.append(TensorShard(torch.zeros(end - start), start, size))
        noise.add_shards_(shards, STD)
        noise.add_shards_(
            [TensorShard(torch.zeros(3), 0, 3)] if rank == 0 else [TensorShard(torch.zeros(0), 3, 3)], STD
        )
        for part, shard in zip(parts, shards):
            part.append(shard.values)
        requests.append(noise.random._requests)
    return [torch.cat(part) for part in parts], requests


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_shards_end_to_end_are_the_one_process_draw(world):
    whole, requests = _one_process(SIZES, pairs=4)
    shards, shard_requests = _sharded(SIZES, pairs=4, world=world)
    for size, expected, got in zip(SIZES, whole, shards):
        assert torch.equal(expected, got), f"tensor of {size} values differs at world size {world}"
    assert shard_requests == [requests] * world


def test_default_chunks_across_a_chunk_boundary():
    """The real chunk size (2·HOST_CHUNK_PAIRS values), a tensor spanning two chunks cut mid-chunk by the shards."""
    sizes = [2 * GaussianNoise("cpu").sampler.pairs + 11]
    whole, _ = _one_process(sizes, pairs=None)
    shards, _ = _sharded(sizes, pairs=None, world=3)
    assert torch.equal(whole[0], shards[0])
    assert whole[0].std().item() == pytest.approx(STD, rel=0.01)


def test_mutation_noise_drawn_per_rank_breaks_it(monkeypatch):
    """Each rank noising its shard as a tensor of its own (from its first coordinate): the shards repeat one another."""
    monkeypatch.setattr(
        GaussianNoise, "add_shards_", lambda self, shards, std: self.add_([s.values for s in shards], std)
    )
    whole, _ = _one_process(SIZES, pairs=4)
    shards, _ = _sharded(SIZES, pairs=4, world=2)
    assert not all(torch.equal(a, b) for a, b in zip(whole, shards))


def test_mutation_a_rank_skipping_its_empty_shards_drifts(monkeypatch):
    """Every rank must take the requests of every tensor, its empty shards' too, or its later draws shift."""
    real = ShardedGaussianSampler.add_
    monkeypatch.setattr(
        ShardedGaussianSampler,
        "add_",
        lambda self, shards, std: real(self, [s for s in shards if s.values.numel()], std),
    )
    whole, _ = _one_process(SIZES, pairs=4)
    shards, requests = _sharded(SIZES, pairs=4, world=2)
    assert len(set(requests)) == 2
    assert not all(torch.equal(a, b) for a, b in zip(whole, shards))


def test_fill_at_reads_the_keystream_of_a_reserved_request_from_any_offset():
    random = SecretRandom(test_seed=SEED)
    whole = bytearray(700)
    random.fill_(whole)  # request 0
    again = SecretRandom(test_seed=SEED)
    assert again.reserve_requests(2) == 0
    for offset, size in [(0, 700), (1, 5), (63, 2), (64, 64), (130, 570), (699, 1)]:
        part = bytearray(size)
        again.fill_at_(part, 0, offset)
        assert part == whole[offset : offset + size]
    other = bytearray(700)
    again.fill_at_(other, 1, 0)
    assert other != whole, "another request has another nonce"


def test_fill_at_refuses_a_request_not_reserved():
    random = SecretRandom(test_seed=SEED)
    random.reserve_requests(1)
    with pytest.raises(ValueError, match="not reserved"):
        random.fill_at_(bytearray(8), 1, 0)


def test_a_draw_prepared_ahead_is_refused_by_a_sharded_release():
    noise = GaussianNoise("cpu", test_seed=SEED, ahead=True)
    noise.prepare([4], STD)
    with pytest.raises(RuntimeError, match="sharded releases do not draw ahead"):
        noise.add_shards_([TensorShard(torch.zeros(2), 0, 4)], STD)
    noise._discard(noise._next)


def test_a_shard_must_fit_its_tensor():
    with pytest.raises(ValueError, match="does not fit"):
        TensorShard(torch.zeros(3), 2, 4)
