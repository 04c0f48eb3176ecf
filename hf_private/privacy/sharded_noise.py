"""Noise for a release split into shards across processes (FSDP2): each coordinate drawn once, by its owner.

One process noising a whole tensor (`GaussianSampler.add_`) draws it in chunks of 2·P values, one keystream request
per chunk; in a chunk of n values (p = ⌈n/2⌉ pairs) value j < p is pair j's cosine draw and value p + j its sine draw,
and pair k reads radius bytes [8k, 8k + 8) and angle bytes [8p + 4k, 8p + 4k + 4) of the request's keystream.

A shard owns a contiguous range of the tensor's flat coordinates (FSDP2 shards dim 0 of a contiguous tensor). Its
owner reserves the requests of the whole tensor, as one process would (so every process's request counter stays in
step), and for each chunk its range touches reads only those pairs' bytes, by seeking ChaCha20's block counter
(`SecretRandom.fill_at_`), then applies the same elementwise arithmetic (`BoxMuller`). So under one key the value at
coordinate i of a tensor is the same whatever the number of processes, and the shards of a draw put end to end are
exactly the draw one process makes. Each process keeps its own secret key: a coordinate is drawn by one owner only,
so independent keys keep every coordinate's noise fresh and independent, and no key crosses the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .rng import BoxMuller, SecretRandom


@dataclass(frozen=True)
class TensorShard:
    """This process's part of one noised tensor: `values` (contiguous) holds the tensor's flat coordinates
    [start, start + values.numel()) of `numel` in all."""

    values: torch.Tensor
    start: int
    numel: int

    def __post_init__(self) -> None:
        if not self.values.is_contiguous():
            raise ValueError("A shard's values must be contiguous to be noised in place.")
        if not 0 <= self.start <= self.start + self.values.numel() <= self.numel:
            raise ValueError(
                f"A shard of {self.values.numel()} values from coordinate {self.start} does not fit in a tensor of "
                f"{self.numel}."
            )


class ShardedGaussianSampler:
    """Adds to each shard the N(0, std²) values that `GaussianSampler(random, pairs_per_chunk).add_` would add to the
    same coordinates of the whole tensor, reading only the keystream those coordinates use."""

    def __init__(self, random: SecretRandom, pairs_per_chunk: int, device: torch.device | str = "cpu") -> None:
        """`pairs_per_chunk`: the P of the one-process sampler this one must agree with (its `pairs`)."""
        self.random = random
        self.pairs = int(pairs_per_chunk)
        self.device = torch.device(device)
        self._box_muller = BoxMuller(self.pairs, self.device)
        self._cos = torch.empty(self.pairs, dtype=torch.float32, device=self.device)
        self._sin = torch.empty(self.pairs, dtype=torch.float32, device=self.device)
        self._radius_bytes = bytearray(8 * self.pairs)
        self._angle_bytes = bytearray(4 * self.pairs)

    def add_(self, shards: Sequence[TensorShard], std: float) -> None:
        """shard.values += the noise of its coordinates, for each shard in the release's order (every process the
        same tensors in the same order, an empty shard included)."""
        step = 2 * self.pairs
        for shard in shards:
            first = self.random.reserve_requests(math.ceil(shard.numel / step))
            flat = shard.values.view(-1)
            end = shard.start + flat.numel()
            chunks = range(shard.start // step, math.ceil(end / step)) if end > shard.start else range(0)
            for chunk in chunks:
                chunk_start = chunk * step
                lo, hi = max(shard.start, chunk_start), min(end, chunk_start + step)
                size = min(step, shard.numel - chunk_start)
                values = self._chunk_part(first + chunk, size, lo - chunk_start, hi - chunk_start, std)
                flat[lo - shard.start : hi - shard.start].add_(values)

    def _chunk_part(self, request: int, size: int, lo: int, hi: int, std: float) -> torch.Tensor:
        """Values [lo, hi) of the chunk of `size` values drawn by `request`."""
        pairs = (size + 1) // 2
        # the pairs behind values [lo, hi): cosines of pairs [lo, min(hi, p)), sines of pairs [max(lo, p) − p, hi − p)
        spans = [(lo, min(hi, pairs)), (max(lo, pairs) - pairs, hi - pairs)]
        used = [(a, b) for a, b in spans if a < b]
        first, last = min(a for a, _ in used), max(b for _, b in used)
        count = last - first
        radius_bytes = memoryview(self._radius_bytes)[: 8 * count]
        angle_bytes = memoryview(self._angle_bytes)[: 4 * count]
        self.random.fill_at_(radius_bytes, request, 8 * first)
        self.random.fill_at_(angle_bytes, request, 8 * pairs + 4 * first)
        cos, sin = self._cos[:count], self._sin[:count]
        self._box_muller.normals_(
            torch.frombuffer(radius_bytes, dtype=torch.uint8).to(self.device),
            torch.frombuffer(angle_bytes, dtype=torch.uint8).to(self.device),
            std,
            cos,
            sin,
        )
        parts = []
        if lo < pairs:
            parts.append(cos[lo - first : min(hi, pairs) - first])
        if hi > pairs:
            parts.append(sin[max(lo, pairs) - pairs - first : hi - pairs - first])
        return torch.cat(parts) if len(parts) > 1 else parts[0]
