"""What the engine does with one chunk's per-example terms once they are collected: a reducer.

The engine (core.py) collects: hooks, terms, row checks, its self-check against autograd, the rows of a
multiple-choice example grouped into one term, a method's term transforms (masks). It then hands a reducer one
`ChunkTerms`: for every trainable parameter the list of its terms (each term one row per example) and the number of
examples. A reducer computes what it releases from them and keeps it until it is popped; nothing else survives the
chunk.

Here are the interface (`Reducer`, `ChunkTerms`, `flat_norms`) and DP-SGD's `FlatL2ClipReducer`, the default: one
flat L2 norm per example over every trainable tensor, clip to C, accumulate the clipped sums the optimizer noises and
releases; an example whose norm is not finite contributes exactly zero. A reducer that only one method uses lives in
that method's folder (DP-FROST's partition magnitudes: `methods/frost/reducer.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .sharding import is_sharded, reduce_scatter_to_shard
from .terms import FactorGrams, accumulation_dtype, cast_term, clipped_sum, combined_squared_norm, zero_examples

# max_grad_norm / (norm + _CLIP_STABILITY): the flat clip's factor, as DP-SGD has always computed it here
_CLIP_STABILITY = 1e-6


@dataclass
class ChunkTerms:
    """One chunk's per-example terms, as the engine hands them to a reducer.

    `terms[param]`: the terms of one trainable parameter (several for a tied or reused parameter), every one of
    `examples` rows (one per example) and already transformed by the method's term transforms. Parameters the chunk
    did not reach are absent. A reducer may empty a parameter's list (`terms[param] = []`) once used, to free memory.
    """

    examples: int
    terms: dict[nn.Parameter, list]


def flat_norms(chunk: ChunkTerms) -> torch.Tensor:
    """Each example's L2 norm over the concatenation of all trainable tensors (cross terms of shared ones included)."""
    norms_sq = None
    grams = FactorGrams()  # one parameter's input factor is often the next one's (Q, K, V)
    for param, terms in chunk.terms.items():
        contribution = combined_squared_norm(terms, accumulation_dtype(param), grams)
        norms_sq = contribution if norms_sq is None else norms_sq + contribution.to(norms_sq.dtype)
    return norms_sq.sqrt() if norms_sq is not None else torch.zeros(chunk.examples)


class Reducer:
    """Turns each chunk's per-example terms into a running result, released by the caller between logical batches."""

    #: C of a reducer that clips each example's flat L2 norm (`engine.max_grad_norm` reads and sets it); declared
    #: only, so reading it from a reducer without one still raises AttributeError
    max_grad_norm: float

    def bind(self, parameters: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Called when the engine adopts the reducer, with the engine's trainable parameters: refuse a mismatch."""

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        """Add the chunk to the running result; return the per-example norms that the reducer clipped."""
        raise NotImplementedError

    def pending(self) -> bool:
        """Whether something is accumulated and not yet popped."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything accumulated (an interrupted logical batch is never released)."""
        raise NotImplementedError


@runtime_checkable
class ClippedSumReducer(Protocol):
    """A reducer whose result is per-parameter clipped gradient sums, the only result the optimizer may noise and
    release (`FlatL2ClipReducer`); the engine refuses to hand the optimizer anything from another reducer."""

    max_grad_norm: float
    sums: dict[nn.Parameter, torch.Tensor]

    def pop_clipped_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """The sums since the last pop, handed over; accumulation starts afresh."""
        ...


class FlatL2ClipReducer(Reducer):
    """DP-SGD's one flat clip: g_b · min(1, C / (‖g_b‖₂ + 1e-6)) summed per parameter.

    ‖g_b‖₂ covers every tensor the optimizer updates. The sums stay in the parameter's dtype promoted to at least
    float32 until `pop_clipped_sums` hands them to the optimizer; FSDP2-sharded parameters' sums are this process's
    shards of the sums over every process.
    """

    def __init__(self, max_grad_norm: float) -> None:
        self.max_grad_norm = float(max_grad_norm)
        self.sums: dict[nn.Parameter, torch.Tensor] = {}
        self._parameters: list[nn.Parameter] = []

    def bind(self, parameters: Sequence[tuple[str, nn.Parameter]]) -> None:
        self._parameters = [param for _, param in parameters]

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        norms = flat_norms(chunk)
        factors = (self.max_grad_norm / (norms + _CLIP_STABILITY)).clamp(max=1.0)
        by_param = chunk.terms
        finite = torch.isfinite(norms)
        if not bool(finite.all()):  # one check per chunk keeps the common path cheap
            # A NaN label or an overflow must not turn the release into NaN exactly when that record is sampled.
            factors = torch.where(finite, factors, 0.0)
            by_param = {p: [zero_examples(t, finite) for t in terms] for p, terms in by_param.items()}
        if is_sharded(self._parameters):
            self._add_to_shards(by_param, factors)
            return norms
        for param, terms in by_param.items():
            dtype = accumulation_dtype(param)
            for term in terms:
                running = self.sums.get(param)
                self.sums[param] = clipped_sum(cast_term(term, dtype), factors.to(dtype), param.shape, running)
            by_param[param] = []  # release this parameter's stored factors as soon as they are used
        return norms

    def _add_to_shards(self, by_param: dict[nn.Parameter, list], factors: torch.Tensor) -> None:
        """FSDP2: each parameter's clipped sum of the chunk, summed over processes and cut to this process's rows at
        once (one reduce-scatter, as FSDP reduces a gradient after each backward), then added to the running sum of
        this process's shard, so that no process holds a whole model's sums across the micro-batches of a step (the
        memory sharding saves). Every process reduce-scatters every parameter in the same order, zeros where its
        chunk has no terms for one (an expert no token here was routed to), as collectives require."""
        for param in self._parameters:
            dtype = accumulation_dtype(param)
            chunk_sum = None
            for term in by_param.pop(param, []):
                chunk_sum = clipped_sum(cast_term(term, dtype), factors.to(dtype), param.shape, chunk_sum)
            if chunk_sum is None:
                chunk_sum = torch.zeros(param.shape, dtype=dtype, device=param.device)
            shard = reduce_scatter_to_shard(chunk_sum, param)
            del chunk_sum
            running = self.sums.get(param)
            self.sums[param] = shard if running is None else running.add_(shard)

    def pop_clipped_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return sums

    def pending(self) -> bool:
        return bool(self.sums)

    def reset(self) -> None:
        self.sums = {}
