"""Noise drawn ahead (`GaussianNoise.prepare`): the same values as drawn in the step, each draw used at most once.

The quality tests of the draws (KS, variance, tails) are in test_secret_random.py and run on the drawn-ahead path;
here the drawn-ahead values are shown to be the synchronous path's bit for bit, so those tests cover both.
"""

from __future__ import annotations

import functools
import itertools
import threading

import pytest
import torch

from hf_private import DPConfig
from hf_private.privacy import GaussianNoise
from hf_private.privacy.noise import _Draw
from hf_private.run import privacy_run as run
from tests.support import tiny
from tests.support.helpers import make_trainer

SIZES = [1000, 3, 600_001]  # an odd size, and one over a chunk (2¹⁹ values)
STD = 0.7
CHUNKS = 1 + 1 + 2  # one request per chunk of 2¹⁹ values of each tensor


def _release(noise: GaussianNoise, std: float = STD, sizes: list[int] = SIZES, prepare: bool = True) -> torch.Tensor:
    tensors = [torch.zeros(size) for size in sizes]
    if prepare:
        noise.prepare(sizes, std)
    noise.add_(tensors, std)
    return torch.cat(tensors)


def test_drawn_ahead_equals_drawn_in_the_step_bit_for_bit():
    ahead, in_step = GaussianNoise("cpu", test_seed=5, ahead=True), GaussianNoise("cpu", test_seed=5)
    for _ in range(3):
        assert torch.equal(_release(ahead), _release(in_step, prepare=False))
    assert ahead.random._requests == in_step.random._requests
    assert in_step._values is None, "without drawing ahead no parameter-sized buffer is kept"


def test_a_draw_for_other_sizes_or_std_is_discarded_never_used():
    noise = GaussianNoise("cpu", test_seed=6, ahead=True)
    noise.prepare(SIZES, STD)
    drawn = noise._next
    other = _release(noise, std=2 * STD, prepare=False)  # another std: drawn in the step, from later requests
    assert drawn.spent and noise._next is None and noise._used == 0
    assert noise.random._requests == 2 * CHUNKS
    with pytest.raises(RuntimeError, match="already used or discarded"):
        drawn.take()
    noise.prepare([5], STD)
    drawn = noise._next
    noise.add_([torch.zeros(6)], STD)  # other sizes: drawn in the step too
    assert drawn.spent and noise._used == 0
    again = GaussianNoise("cpu", test_seed=6, ahead=True)  # the discards happen in the same order: replay still holds
    again.prepare(SIZES, STD)
    assert torch.equal(_release(again, std=2 * STD, prepare=False), other)


def test_prepare_twice_for_the_same_release_draws_once():
    noise = GaussianNoise("cpu", test_seed=7, ahead=True)
    noise.prepare(SIZES, STD)
    first = noise._next
    noise.prepare(SIZES, STD)
    assert noise._next is first and noise._generations == 1
    GaussianNoise("cpu").prepare(SIZES, STD)  # a no-op: on a CPU only when asked for


def test_a_draw_is_never_used_twice():
    noise = GaussianNoise("cpu", test_seed=8, ahead=True)
    noise.prepare(SIZES, STD)
    used = noise._next
    _release(noise, prepare=False)
    with pytest.raises(RuntimeError, match="already used or discarded"):
        used.take()
    noise._next = used  # put back a used draw: refused
    with pytest.raises(RuntimeError, match="already used or discarded"):
        noise.add_([torch.zeros(size) for size in SIZES], STD)
    _release(noise)
    stale = _Draw(1, (tuple(SIZES), STD), torch.empty(sum(SIZES)), noise.sampler)  # unspent, but an old generation
    noise._next = stale
    with pytest.raises(RuntimeError, match="not newer"):
        noise.add_([torch.zeros(size) for size in SIZES], STD)


def _largest_overlap(releases: list[torch.Tensor]) -> float:
    """The largest share of coordinates two releases have equal: ≈ 0 for fresh draws, 1 for a reused one."""
    return max(float((a == b).double().mean()) for a, b in itertools.combinations(releases, 2))


def test_every_release_comes_from_fresh_requests():
    noise = GaussianNoise("cpu", test_seed=9, ahead=True)
    releases = []
    for _ in range(12):
        before = noise.random._requests
        releases.append(_release(noise))
        assert noise.random._requests == before + CHUNKS
    assert _largest_overlap(releases) < 1e-3
    assert not [thread for thread in threading.enumerate() if thread.name == "hf_private noise"]


def test_mutation_a_buffer_left_undrawn_fails_the_freshness_check(monkeypatch):
    noise = GaussianNoise("cpu", test_seed=9, ahead=True)
    releases = [_release(noise)]
    monkeypatch.setattr(_Draw, "_draw", lambda self, sampler: None)  # the buffer keeps the last release's values
    releases.append(_release(noise))
    assert _largest_overlap(releases) == 1.0


def test_a_failed_draw_raises_in_the_step(monkeypatch):
    noise = GaussianNoise("cpu", test_seed=10, ahead=True)

    def broken(tensor, std):
        raise OSError("no entropy")

    monkeypatch.setattr(noise.sampler, "draw_", broken)
    noise.prepare(SIZES, STD)
    with pytest.raises(RuntimeError, match="ahead failed"):
        noise.add_([torch.zeros(size) for size in SIZES], STD)


def test_a_device_other_than_cpu_draws_ahead_through_the_copy_path():
    # The meta device takes the sampler's non-CPU branch (keystream copied to the device); no values to check.
    noise = GaussianNoise("meta", test_seed=11)  # ahead by default off the CPU
    tensors = [torch.zeros(size, device="meta") for size in SIZES]
    noise.prepare(SIZES, STD)
    noise.add_(tensors, STD)
    assert noise._used == 1 and tensors[2].device.type == "meta"


def test_every_training_step_adds_noise_drawn_ahead(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "GaussianNoise", functools.partial(GaussianNoise, ahead=True))  # as on an accelerator
    taken = []
    take = _Draw.take
    monkeypatch.setattr(_Draw, "take", lambda self: taken.append(self.generation) or take(self))
    trainer = make_trainer(
        tmp_path,
        model=tiny.bert(),
        dataset=tiny.sentiment_dataset(32),
        dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3),
        num_train_epochs=1,
    )
    trainer.train()
    noise = trainer.privacy_run.optimizer.noise
    assert taken == list(range(1, trainer.training_steps() + 1)) and noise._generations == len(taken)
