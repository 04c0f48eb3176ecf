"""DP-FROST's partition-wise gradient magnitudes (methods_spec §2.2 Def. 8 and §2.6): the engine reducer its selection
rounds use.

μ ∈ ℝ^M of DP-MG, DP-MGN or DP-MGNA for α ∈ {1, 2}, exactly as defined: each example's gradient on the union of the
partitions (raw for MG, normalised per partition for MGN, its absolute value for MGNA) clipped in the α-norm at c (MG)
or c̄ (MGN, MGNA), summed over the examples, then the α-norm of the sum on each partition. It adds no noise: the
method noises the popped vector through the secret noise source, with the reducer's `sensitivity` (Lemma 3). An
example whose result is not finite contributes exactly zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ...engine.reducers import ChunkTerms, Reducer
from ...engine.terms import (
    accumulation_dtype,
    cast_term,
    clipped_abs_sum,
    clipped_sum,
    combined_l1_norm,
    combined_squared_norm,
    zero_examples,
)


class PartitionMagnitudeReducer(Reducer):
    """DP-FROST's partition-wise gradient magnitudes (PGMs, methods_spec §2.2 Def. 8), summed exactly (no noise).

    `partitions` = S = (P_1, …, P_M): disjoint groups of whole trainable parameters (DP-FROST: one weight matrix
    with its bias; a tied tensor belongs to one partition only), the *current candidate set* (later PSEL rounds
    pass the remaining partitions only). Trainable parameters in no partition are ignored: they enter neither a
    norm nor a sum. g(x) is example x's gradient on ∪S, α = `order` ∈ {1, 2}, c = `clip`, |P| a parameter count,
    C^α_κ(v) = min(1, κ/‖v‖_α)·v, ĝ(x) = g_{P_1}(x)/|P_1|^{1/α} ⊕ … ⊕ g_{P_M}(x)/|P_M|^{1/α}, and
    c̄ = `normalized_clip` = c / (Σ_i|P_i| / M)^{1/α}. `pop_magnitudes` returns μ ∈ ℝ^M with, for `variant`:

    * "mg":   μ_i = ‖Σ_x [C^α_c(g(x))]_{P_i}‖_α / |P_i|^{1/α}    (sensitivity c / (min_i |P_i|)^{1/α})
    * "mgn":  μ_i = ‖Σ_x [C^α_c̄(ĝ(x))]_{P_i}‖_α                 (sensitivity c̄)
    * "mgna": μ_i = ‖Σ_x [C^α_c̄(abs ĝ(x))]_{P_i}‖_α            (sensitivity c̄; the default, DP-FROST's DP-MGNA)

    Every variant clips example x with one factor f_x = min(1, κ/n(x)), n(x) its α-norm over all of ∪S (raw for
    "mg", normalised for the others: ‖ĝ(x)‖_α = ‖abs ĝ(x)‖_α), κ = c or c̄. Then, per partition:

    * "mg" and "mgn": μ_i = ‖S_{P_i}‖_α / |P_i|^{1/α} with S_p = Σ_x f_x g_p(x), the signed clipped sum of each
      parameter p (one contraction from the stored terms, as DP-SGD's clipped sum; nothing B×p×d).
    * "mgna", α = 1: all entries are non-negative, so μ_i = Σ_x f_x ‖g_{P_i}(x)‖₁ / |P_i|: per-example L1 norms only.
    * "mgna", α = 2: μ_i = ‖A_{P_i}‖₂ / |P_i|^{1/2} with A_p = Σ_x f_x abs(g_p(x)) per coordinate: this needs the
      per-example gradients themselves, instantiated a block of examples at a time (`terms.clipped_abs_sum`; a lone
      embedding term through the rows each example touches).

    The sums are accumulated over every chunk until `pop_magnitudes`, which forms the norms in float64. An example
    whose n(x) is not finite contributes exactly zero (its terms are zeroed, not only its factor: 0·NaN is NaN).

    Sensitivity Δ = `sensitivity` (add/remove one example x', Lemma 3): by the reverse triangle inequality μ_i moves
    by at most ‖[v(x')]_{P_i}‖_α, v(x') the clipped vector x' adds (divided by |P_i|^{1/α} for "mg"), so
    ‖Δμ‖₂ ≤ ‖v(x')‖_α ≤ κ (α = 2: the partition L2 norms compose; α = 1: ‖·‖₂ ≤ ‖·‖₁ and the clip is in L1), times
    1/(min_i |P_i|)^{1/α} for "mg". Noise N(0, σ_ps² Δ² I_M) on μ is then the Gaussian mechanism.

    Unlike the flat clip there is no stability constant: c̄ and the normalised norms are as small as mean absolute
    coordinates (c̄ ≈ c/10⁶ on RoBERTa-base), and f_x = κ / max(κ, n(x)) is exact.
    """

    VARIANTS = ("mg", "mgn", "mgna")

    def __init__(
        self, partitions: Sequence[Iterable[nn.Parameter]], clip: float, *, order: int = 1, variant: str = "mgna"
    ) -> None:
        if order not in (1, 2):
            raise ValueError(f"order must be 1 (L1) or 2 (L2), got {order}.")
        if variant not in self.VARIANTS:
            raise ValueError(f"variant must be one of {self.VARIANTS} (DP-MG, DP-MGN, DP-MGNA), got {variant!r}.")
        if not clip > 0 or not math.isfinite(clip):
            raise ValueError(f"The magnitude clip must be positive and finite, got {clip}.")
        self.partitions = [list(group) for group in partitions]
        if not self.partitions or any(not group for group in self.partitions):
            raise ValueError("Every partition needs at least one parameter, and there must be at least one partition.")
        self.index: dict[nn.Parameter, int] = {}
        for i, group in enumerate(self.partitions):
            for param in group:
                if param in self.index:
                    raise ValueError(
                        f"A parameter of shape {tuple(param.shape)} is in partitions {self.index[param]} "
                        f"and {i}: partitions must be disjoint (a tied tensor belongs to one of them)."
                    )
                self.index[param] = i
        self.order = order
        self.variant = variant
        self.clip = float(clip)
        sizes = [sum(p.numel() for p in group) for group in self.partitions]
        if min(sizes) == 0:
            raise ValueError("Every partition needs at least one coordinate.")
        self.sizes = torch.tensor(sizes, dtype=torch.float64)
        #: c̄ = c / (mean partition size)^{1/α}, the clip of the normalised gradient ("mgn", "mgna")
        self.normalized_clip = self.clip / (sum(sizes) / len(sizes)) ** (1 / order)
        #: κ: the threshold each example's α-norm (raw for "mg", normalised otherwise) is clipped to
        self.bound = self.clip if variant == "mg" else self.normalized_clip
        #: the dtype of the per-example magnitudes, the factors and μ: float64 or wider
        self.dtype = torch.promote_types(torch.float64, _widest(p.dtype for p in self.index))
        self.sums: dict[nn.Parameter, torch.Tensor] = {}  # S_p ("mg", "mgn") or A_p ("mgna", α = 2)
        self.totals: torch.Tensor | None = None  # μ itself ("mgna", α = 1)
        self._recorded = False

    @property
    def device(self) -> torch.device:
        """Where μ is accumulated and returned: the device of the partitions' parameters."""
        return self.partitions[0][0].device

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of μ under add/remove adjacency (Lemma 3): c / (min_i |P_i|)^{1/α} for "mg", else c̄."""
        if self.variant == "mg":
            return self.clip / float(self.sizes.min()) ** (1 / self.order)
        return self.normalized_clip

    def bind(self, parameters: Sequence[tuple[str, nn.Parameter]]) -> None:
        trainable = {p for _, p in parameters}
        missing = [i for i, group in enumerate(self.partitions) if any(p not in trainable for p in group)]
        if missing:
            raise ValueError(
                f"Partitions {missing} hold parameters the engine does not train: their per-example "
                "gradients are never collected. Make them trainable before creating the engine."
            )

    def _powers(self, chunk: ChunkTerms) -> torch.Tensor:
        """[examples, M]: ‖g_{P_i}(x)‖_α^α for every example and partition (zero where the chunk did not reach P_i)."""
        device = next((p.device for p in chunk.terms), self.device)
        powers = torch.zeros(chunk.examples, len(self.partitions), dtype=self.dtype, device=device)
        for param, terms in chunk.terms.items():
            i = self.index.get(param)
            if i is None or not terms:
                continue
            dtype = accumulation_dtype(param)
            part = combined_l1_norm(terms, dtype) if self.order == 1 else combined_squared_norm(terms, dtype)
            powers[:, i] += part.to(self.dtype)
        # cross terms of a tied tensor can round a squared norm below zero; clamping keeps NaN (dropped later)
        return powers if self.order == 1 else powers.clamp_(min=0.0)

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        powers = self._powers(chunk)
        if self.variant != "mg":  # ‖g_{P_i}‖_α^α / |P_i| = ‖ĝ_{P_i}‖_α^α
            powers = powers / self.sizes.to(powers.device, self.dtype)
        norms = powers.sum(1) if self.order == 1 else powers.sum(1).sqrt()
        factors = self.bound / torch.maximum(norms, norms.new_tensor(self.bound))  # min(1, κ/n), exactly
        finite = torch.isfinite(norms)
        all_finite = bool(finite.all())  # one check per chunk keeps the common path cheap
        if not all_finite:
            factors = torch.where(finite, factors, 0.0)
        self._recorded = True
        if self.variant == "mgna" and self.order == 1:
            contributions = torch.where(finite.unsqueeze(1), powers * factors.unsqueeze(1), 0.0)
            total = contributions.sum(0).to(self.device)
            self.totals = total if self.totals is None else self.totals + total
            for param in chunk.terms:
                chunk.terms[param] = []
            return norms
        for param, terms in chunk.terms.items():
            if param in self.index and terms:
                if not all_finite:
                    terms = [zero_examples(t, finite) for t in terms]
                dtype = accumulation_dtype(param)
                scale = factors.to(dtype)
                if self.variant == "mgna":
                    self.sums[param] = clipped_abs_sum(terms, scale, param.shape, dtype, self.sums.get(param))
                else:
                    for term in terms:
                        self.sums[param] = clipped_sum(cast_term(term, dtype), scale, param.shape, self.sums.get(param))
            chunk.terms[param] = []  # release this parameter's terms as soon as they are used
        return norms

    def pop_magnitudes(self) -> torch.Tensor:
        """μ ∈ ℝ^M (float64 or wider) over every chunk since the last pop (zeros if nothing was recorded); resets."""
        if self.totals is not None:
            result = self.totals
        else:
            powers = torch.zeros(len(self.partitions), dtype=self.dtype, device=self.device)
            for param, total in self.sums.items():
                total = total.to(self.device, self.dtype)
                part = total.abs().sum() if self.order == 1 else total.pow(2).sum()
                powers[self.index[param]] += part
            sizes = self.sizes.to(self.device, self.dtype)
            result = powers / sizes if self.order == 1 else (powers / sizes).sqrt()
        self.reset()
        return result

    def pending(self) -> bool:
        return self._recorded

    def reset(self) -> None:
        self.sums = {}
        self.totals = None
        self._recorded = False


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    widest = torch.float32
    for dtype in dtypes:
        widest = torch.promote_types(widest, dtype)
    return widest
