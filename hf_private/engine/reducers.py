"""What the engine does with one chunk's per-example terms once they are collected: a reducer.

The engine (core.py) collects: hooks, terms, row checks, its self-check against autograd, the rows of a
multiple-choice example grouped into one term, a method's term transforms (masks). It then hands a reducer one
`ChunkTerms`: for every trainable parameter the list of its terms (each term one row per example) and the number of
examples. A reducer computes what it releases from them and keeps it until it is popped; nothing else survives the
chunk.

* `FlatL2ClipReducer` (DP-SGD, the default): one flat L2 norm per example over every trainable tensor, clip to C,
  accumulate the clipped sums the optimizer noises and releases.
* `PartitionMagnitudeReducer` (DP-FROST's selection, methods_spec §2.2 and §2.6): per example, the L1 or L2 norm of
  its gradient on each partition (a group of whole parameters: one weight matrix with its bias), optionally
  normalised by the partition size, that vector of magnitudes clipped in the same norm, summed over examples. It
  adds no noise: the method noises the popped vector through the secret noise source.

Either way an example whose result is not finite contributes exactly zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .terms import accumulation_dtype, cast_term, clipped_sum, combined_l1_norm, combined_squared_norm, zero_examples

# max_grad_norm / (norm + _CLIP_STABILITY): the flat clip's factor, as DP-SGD has always computed it here
_CLIP_STABILITY = 1e-6


@dataclass
class ChunkTerms:
    """One chunk's per-example terms, as the engine hands them to a reducer.

    `terms[param]`: the terms of one trainable parameter (several for a tied or reused parameter), every one of
    `examples` rows (one per example) and already transformed by the method's term transforms. Parameters the chunk
    did not reach are absent. A reducer may drop a parameter's entry (set it to None) once used, to free memory.
    """

    examples: int
    terms: dict[nn.Parameter, list | None]


def flat_norms(chunk: ChunkTerms) -> torch.Tensor:
    """Each example's L2 norm over the concatenation of all trainable tensors (cross terms of shared ones included)."""
    norms_sq = None
    for param, terms in chunk.terms.items():
        contribution = combined_squared_norm(terms, accumulation_dtype(param))
        norms_sq = contribution if norms_sq is None else norms_sq + contribution.to(norms_sq.dtype)
    return norms_sq.sqrt() if norms_sq is not None else torch.zeros(chunk.examples)


class Reducer:
    """Turns each chunk's per-example terms into a running result, released by the caller between logical batches."""

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


class FlatL2ClipReducer(Reducer):
    """DP-SGD's one flat clip: g_b · min(1, C / (‖g_b‖₂ + 1e-6)) summed per parameter.

    ‖g_b‖₂ covers every tensor the optimizer updates. The sums stay in the parameter's dtype promoted to at least
    float32 until `pop_clipped_sums` hands them to the optimizer.
    """

    def __init__(self, max_grad_norm: float) -> None:
        self.max_grad_norm = float(max_grad_norm)
        self.sums: dict[nn.Parameter, torch.Tensor] = {}

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        norms = flat_norms(chunk)
        factors = (self.max_grad_norm / (norms + _CLIP_STABILITY)).clamp(max=1.0)
        by_param = chunk.terms
        finite = torch.isfinite(norms)
        if not bool(finite.all()):  # one check per chunk keeps the common path cheap
            # A NaN label or an overflow must not turn the release into NaN exactly when that record is sampled.
            factors = torch.where(finite, factors, 0.0)
            by_param = {p: [zero_examples(t, finite) for t in terms] for p, terms in by_param.items()}
        for param, terms in by_param.items():
            dtype = accumulation_dtype(param)
            for term in terms:
                running = self.sums.get(param)
                self.sums[param] = clipped_sum(cast_term(term, dtype), factors.to(dtype), param.shape, running)
            by_param[param] = None  # release this parameter's stored factors as soon as they are used
        return norms

    def pop_clipped_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return sums

    def pending(self) -> bool:
        return bool(self.sums)

    def reset(self) -> None:
        self.sums = {}


class PartitionMagnitudeReducer(Reducer):
    """Σ_x clip_Δ(m(x)): per-example, per-partition gradient magnitudes, clipped per example, summed (no noise).

    `partitions[i]` is a group of whole parameters (DP-FROST: one weight matrix with its bias; a tied tensor
    belongs to one partition only). For example x and partition P_i, with α = `order`:

        m_i(x) = ‖g_{P_i}(x)‖_α / |P_i|^{1/α}     (`normalize=True`, the spec's ĝ; else without the division)

    m(x) is clipped in the α-norm to `clip` (Δ, the spec's c̄: the clip c over the α-root of the mean partition
    size of the current candidate set) with factor min(1, Δ/‖m(x)‖_α), then summed over the examples. With α = 1
    this is exactly DP-MGNA's μ (methods_spec §2.2: all entries are non-negative, so the L1 norm of the sum is the
    sum of L1 norms). With α = 2 it is Σ_x ‖[C(abs ĝ(x))]_{P_i}‖₂, an upper bound of MGNA's ‖Σ_x[C(abs ĝ(x))]_{P_i}‖₂
    with the same sensitivity.

    Sensitivity (add/remove one example): the sum moves by clip_Δ(m(x')), whose L2 norm is at most its α-norm ≤ Δ
    for α ∈ {1, 2}; so N(0, σ_ps²Δ²) per partition is the Gaussian mechanism of Lemma 3. Trainable parameters in
    no partition (already selected, or not candidates) are ignored: they enter neither the norm nor the sum.
    Unlike the flat clip there is no stability constant: Δ and the normalised magnitudes are as small as mean
    absolute coordinates (c̄ ≈ c/10⁶ on RoBERTa-base), and Δ / max(Δ, ‖m‖) is exact.
    """

    def __init__(self, partitions: Sequence[Iterable[nn.Parameter]], clip: float, *, order: int = 1,
                 normalize: bool = True) -> None:
        if order not in (1, 2):
            raise ValueError(f"order must be 1 (L1) or 2 (L2), got {order}.")
        if not clip > 0:
            raise ValueError(f"The magnitude clip must be positive, got {clip}.")
        self.partitions = [list(group) for group in partitions]
        if not self.partitions or any(not group for group in self.partitions):
            raise ValueError("Every partition needs at least one parameter, and there must be at least one partition.")
        self.index: dict[nn.Parameter, int] = {}
        for i, group in enumerate(self.partitions):
            for param in group:
                if param in self.index:
                    raise ValueError(f"A parameter of shape {tuple(param.shape)} is in partitions {self.index[param]} "
                                     f"and {i}: partitions must be disjoint (a tied tensor belongs to one of them).")
                self.index[param] = i
        self.order = order
        self.clip = float(clip)
        self.normalize = normalize
        self.sizes = torch.tensor([sum(p.numel() for p in group) for group in self.partitions], dtype=torch.float64)
        self.dtype = torch.promote_types(torch.float32, _widest(p.dtype for p in self.index))
        self.sums: torch.Tensor | None = None

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the summed vector under add/remove adjacency."""
        return self.clip

    def bind(self, parameters: Sequence[tuple[str, nn.Parameter]]) -> None:
        trainable = {p for _, p in parameters}
        missing = [i for i, group in enumerate(self.partitions) if any(p not in trainable for p in group)]
        if missing:
            raise ValueError(f"Partitions {missing} hold parameters the engine does not train: their per-example "
                             "gradients are never collected. Make them trainable before creating the engine.")

    def magnitudes(self, chunk: ChunkTerms) -> torch.Tensor:
        """[examples, M]: m_i(x) for every example and partition (zero for a partition the chunk did not reach)."""
        device = next((p.device for p in chunk.terms), None)
        powers = torch.zeros(chunk.examples, len(self.partitions), dtype=self.dtype, device=device)
        for param, terms in chunk.terms.items():
            i = self.index.get(param)
            if i is None:
                continue
            dtype = accumulation_dtype(param)
            part = combined_l1_norm(terms, dtype) if self.order == 1 else combined_squared_norm(terms, dtype)
            powers[:, i] += part.to(self.dtype)
        sizes = self.sizes.to(self.dtype).to(powers.device)
        if self.order == 1:
            return powers / sizes if self.normalize else powers
        return (powers / sizes).sqrt() if self.normalize else powers.sqrt()

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        magnitudes = self.magnitudes(chunk)
        norms = magnitudes.sum(1) if self.order == 1 else magnitudes.pow(2).sum(1).sqrt()
        factors = self.clip / torch.maximum(norms, norms.new_tensor(self.clip))
        finite = torch.isfinite(norms)
        contributions = torch.where(finite.unsqueeze(1), magnitudes * factors.unsqueeze(1), 0.0)
        total = contributions.sum(0)
        self.sums = total if self.sums is None else self.sums + total
        for param in chunk.terms:
            chunk.terms[param] = None
        return norms

    def pop_magnitudes(self) -> torch.Tensor:
        """The [M] vector Σ_x clip_Δ(m(x)) over every chunk since the last pop (zeros if nothing was recorded)."""
        sums = self.sums if self.sums is not None else torch.zeros(len(self.partitions), dtype=self.dtype)
        self.reset()
        return sums

    def pending(self) -> bool:
        return self.sums is not None

    def reset(self) -> None:
        self.sums = None


def partitions_by_module(model: nn.Module) -> list[list[nn.Parameter]]:
    """DP-FROST's partitions (methods_spec §2.1): each module's own trainable parameters (a weight with its bias).

    A tensor tied between two modules (input embedding and LM head) belongs to the first module that holds it.
    """
    seen: set[nn.Parameter] = set()
    partitions = []
    for module in model.modules():
        group = [p for p in module._parameters.values() if p is not None and p.requires_grad and p not in seen]
        if group:
            seen.update(group)
            partitions.append(group)
    return partitions


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    widest = torch.float32
    for dtype in dtypes:
        widest = torch.promote_types(widest, dtype)
    return widest
