"""Per-example gradient terms in factored form, and the algebra the clip needs on them.

A layer call contributes to a parameter's per-example gradient in one of three shapes:

* `OuterTerm`:   g_b = Σ_t left[b,t] ⊗ right[b,t]   (Linear, Conv1D weights, kept factored for the ghost norm)
* `IndexTerm`:   g_b = Σ_t e_{index[b,t]} ⊗ right[b,t]  (Embedding weights; rows picked by token id)
* `SampleTerm`:  g_b given explicitly, shape [B, *param.shape]  (biases, norm gains: cheap to hold)
* `RoutedOuterTerm`: g_b[e] = Σ_{s of b routed to e} left[s] ⊗ right[s]  (a mixture of experts' stacked expert
  weights [E, P, D]: one factor pair per (token, expert) pair the router chose; `routed_outer_term` instantiates
  [B, E, P, D] instead where that is no larger than the pairs, as `outer_product_term` does for a linear layer)

Besides the L2 algebra of the flat clip (`squared_norm`, `inner`, `clipped_sum`) this module holds what reducers and
methods need on the same terms: an L1 norm (`combined_l1_norm`), and masks applied to every example's gradient
(`zero_rows`, `zero_columns`) without forming B×p×d.

A parameter can receive several terms (tied embeddings, a module called twice); its per-example norm then
needs the cross terms, which `inner` provides, because ‖Σ_i g_i‖² ≠ Σ_i ‖g_i‖².

Dtypes (bf16 autocast): a term is formed in the dtype its layer computed in, which is the dtype of the layer's
output and so of its output gradient. Autocast casts an op's inputs to that compute dtype (bf16 for a matmul fed
by an fp32 norm layer, fp32 for an op it keeps in fp32), so a saved input is brought to it first
(`in_compute_dtype`), just as the forward and autograd's own weight gradient saw it; on the fp32/fp64 path the
two dtypes agree and nothing is cast. Layers that compute statistics in a wider type (RMSNorm) do so in their
handler, as their forward does. The engine then accumulates norms, cross terms and clipped sums in the parameter's
dtype promoted to at least float32, never in bf16.
"""

from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass, replace

import torch


@dataclass
class OuterTerm:
    left: torch.Tensor  # [B, T, P]
    right: torch.Tensor  # [B, T, D]

    @property
    def batch_size(self) -> int:
        return self.left.shape[0]


@dataclass
class PackedOuterTerm(OuterTerm):
    """An OuterTerm of packed examples regathered one per row (`packed_tokens`), each padded to the chunk's longest:
    `real` [B, T] marks each example's own tokens, so that the clipped sum's GEMM runs over those alone (a sorted
    SST-2 chunk's examples padded to their longest hold 1.47× their tokens)."""

    real: torch.Tensor  # [B, T] bool


@dataclass
class IndexTerm:
    index: torch.Tensor  # [B, T] long; positions that must not contribute are masked out of `right`
    right: torch.Tensor  # [B, T, D]
    num_rows: int

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]


@dataclass
class SampleTerm:
    grad: torch.Tensor  # [B, *param.shape]

    @property
    def batch_size(self) -> int:
        return self.grad.shape[0]


@dataclass
class RoutedOuterTerm:
    """Per-example gradients of stacked expert weights [experts, P, D] (`layers/moe.py`), one factor pair per (token,
    expert) pair the router chose: g_b[e] = Σ_{s: example[s] = b, expert[s] = e} left[s] ⊗ right[s].

    An expert's per-example gradient is a linear layer's over the example's tokens routed to it, so the ghost norm
    runs per (example, expert) on its pairs alone and the clipped sum per expert; `routed_outer_term` decides, as for
    a linear layer, whether the pairs or the [B, E, P, D] gradients are the smaller thing to hold.
    """

    left: torch.Tensor  # [S, P]
    right: torch.Tensor  # [S, D]
    example: torch.Tensor  # [S] long: the example (row of the chunk) each pair belongs to
    expert: torch.Tensor  # [S] long: the expert it was routed to
    examples: int
    experts: int

    @property
    def batch_size(self) -> int:
        return self.examples


#: one parameter's per-example gradients as a layer handler forms them
Term = OuterTerm | IndexTerm | SampleTerm | RoutedOuterTerm


def in_compute_dtype(saved: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """A layer's saved input as its op used it: in the dtype of the output gradient (see the module notes)."""
    return saved if saved.dtype == grad_output.dtype else saved.to(grad_output.dtype)


# Gram-matrix multiply-adds worth one pass over an instantiated gradient's values (its norm, its share of the clipped
# sum): a pass is memory-bound, a Gram GEMM is not. With 64 the ghost norm keeps every BERT/GPT-2 weight at T = 128
# and gives way to instantiation for the MLP weights at T = 512 (benchmarks/engine_profile.py, #36).
_GRAM_MACS_PER_PASS = 64
# How much larger than the factors it frees an instantiated gradient may be when it saves Gram work.
_INSTANTIATE_GROWTH = 2


def ghost_norm_is_cheaper(seq_len: int, left_width: int, right_width: int) -> bool:
    """Whether to keep a weight's factors for the ghost norm rather than instantiate its per-example gradient.

    The factors (T·(P+D) values per example) are what the ghost norm must hold until the clip; an instantiated
    gradient (P·D values) replaces them. Instantiating costs one GEMM (the one the ghost path's clipped sum runs
    anyway) and passes over P·D values; the ghost norm costs Gram matrices, T²·(P+D) multiply-adds. So instantiate
    whenever it is no larger than the factors it frees (fastDP's 2T² < P·D rule made exact for the factors actually
    stored: at T = 128 on BERT/GPT-2 shapes they agree), and also when it is at most twice their size and the Gram
    work outweighs the passes (at T = 512 the 768×3072 MLP weights: 1.2× the factors, Grams 427 passes' worth).
    """
    instantiated, factors = left_width * right_width, seq_len * (left_width + right_width)
    if instantiated <= factors:
        return False
    grams = seq_len * seq_len * (left_width + right_width)
    return not (instantiated <= _INSTANTIATE_GROWTH * factors and grams > _GRAM_MACS_PER_PASS * instantiated)


def outer_product_term(left: torch.Tensor, right: torch.Tensor) -> OuterTerm | SampleTerm:
    """Keep Σ_t left ⊗ right factored for the ghost norm, or instantiate it now when that is no larger."""
    if ghost_norm_is_cheaper(left.shape[1], left.shape[2], right.shape[2]):
        return OuterTerm(left=left, right=right)
    return SampleTerm(torch.einsum("btp,btd->bpd", left, right))


def group_rows(term, rows_per_example):
    """One term per unit from its consecutive rows (multiple choice: B·C rows → B; a user: the rows of its examples).

    `rows_per_example`: an int (every unit that many rows) or a sequence of each unit's rows, in order, summing to the
    term's rows. A unit's gradient is the sum over its rows, so its norm must cover all of them. A sum of row gradients
    is a sum over the rows' positions: factored terms simply concatenate the unit's rows along the token axis (exact).
    Units of different sizes are padded with zero rows to the longest one, so that one reshape still serves: a zero
    row adds nothing to a norm, a cross term or a sum. An instantiated term sums its rows into their unit.
    """
    if isinstance(rows_per_example, numbers.Integral) and not isinstance(rows_per_example, bool):
        rows_per_example = int(rows_per_example)
    else:
        sizes = unit_sizes(rows_per_example)
        if term.batch_size != sum(sizes):
            raise ValueError(
                f"group_rows: a term of {term.batch_size} rows cannot be grouped into {len(sizes)} units "
                f"of {sum(sizes)} rows in all ({format_sizes(sizes)})."
            )
        if len(set(sizes)) > 1:
            return _group_unequal_rows(term, sizes)
        rows_per_example = sizes[0] if sizes else 1
    if isinstance(term, SampleTerm):
        grad = term.grad
        return SampleTerm(grad.reshape(-1, rows_per_example, *grad.shape[1:]).sum(1))
    if isinstance(term, RoutedOuterTerm):  # a unit's pairs are its rows' pairs
        return replace(term, example=term.example // rows_per_example, examples=term.examples // rows_per_example)
    if isinstance(term, IndexTerm):
        examples = term.index.shape[0] // rows_per_example
        return IndexTerm(
            index=term.index.reshape(examples, -1),
            right=term.right.reshape(examples, -1, term.right.shape[2]),
            num_rows=term.num_rows,
        )
    examples = term.left.shape[0] // rows_per_example
    # Re-decide ghost vs instantiated: the grouped sequence is rows_per_example times longer.
    return outer_product_term(
        term.left.reshape(examples, -1, term.left.shape[2]), term.right.reshape(examples, -1, term.right.shape[2])
    )


def unit_sizes(sizes) -> tuple[int, ...]:
    """`sizes` (a sequence or 1-D tensor of each unit's rows) as a tuple of ints ≥ 1; anything else is refused."""
    if torch.is_tensor(sizes):
        if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
            raise ValueError(
                f"Unit sizes must be a 1-D integer tensor, got {sizes.dtype} of shape {tuple(sizes.shape)}."
            )
        sizes = sizes.tolist()
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"Unit sizes must be an int or a sequence of ints, got {type(sizes).__name__}.")
    values = tuple(sizes)
    bad = [s for s in values if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
    if bad:
        raise TypeError(f"Unit sizes must be ints, got {bad[:3]!r} in {format_sizes(values)}.")
    values = tuple(int(s) for s in values)
    if any(s < 1 for s in values):
        raise ValueError(f"Every unit needs at least one row: got sizes {format_sizes(values)}.")
    return values


def format_sizes(sizes, most: int = 12) -> str:
    shown = ", ".join(str(s) for s in sizes[:most])
    return f"[{shown}{', ...' if len(sizes) > most else ''}]"


def unit_slots(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every row (a packed row's every token, `packed_tokens`): its unit (owner) and its place among the unit's
    rows (slot)."""
    counts = torch.tensor(sizes, dtype=torch.long, device=device)
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(owner.numel(), device=device) - starts[owner]
    return owner, slot


def padded_by_unit(
    values: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, units: int, longest: int
) -> torch.Tensor:
    """[rows, T, F] → [units, longest·T, F]: each unit's rows one after the other, then zero rows (index 0 for ids)."""
    out = values.new_zeros(units, longest, *values.shape[1:])
    out[owner, slot] = values
    return out.reshape(units, -1, *values.shape[2:])


def _group_unequal_rows(term, sizes: tuple[int, ...]):
    units, longest = len(sizes), max(sizes)
    if isinstance(term, SampleTerm):
        owner, _ = unit_slots(sizes, term.grad.device)
        return SampleTerm(term.grad.new_zeros(units, *term.grad.shape[1:]).index_add_(0, owner, term.grad))
    if isinstance(term, RoutedOuterTerm):
        owner, _ = unit_slots(sizes, term.example.device)
        return replace(term, example=owner[term.example], examples=units)
    if isinstance(term, IndexTerm):
        # A padding position looks up row 0 with a zero gradient: it adds nothing to that row.
        owner, slot = unit_slots(sizes, term.index.device)
        return IndexTerm(
            index=padded_by_unit(term.index, owner, slot, units, longest),
            right=padded_by_unit(term.right, owner, slot, units, longest),
            num_rows=term.num_rows,
        )
    if isinstance(term, OuterTerm):
        owner, slot = unit_slots(sizes, term.left.device)
        # Re-decide ghost vs instantiated for the grouped (padded) sequence length.
        return outer_product_term(
            padded_by_unit(term.left, owner, slot, units, longest),
            padded_by_unit(term.right, owner, slot, units, longest),
        )
    raise TypeError(f"group_rows: no rule to group the rows of a {type(term).__name__} into units of varying sizes.")


def zero_examples(term, keep: torch.Tensor):
    """The term with every example outside `keep` (a [B] bool mask) set to exactly zero.

    A zero clip factor is not enough to drop a non-finite example: 0·NaN and 0·inf are NaN, and would reach the sum.
    """

    def masked(values: torch.Tensor) -> torch.Tensor:
        return torch.where(keep.view(-1, *[1] * (values.dim() - 1)), values, 0.0)

    if isinstance(term, SampleTerm):
        return SampleTerm(masked(term.grad))
    if isinstance(term, IndexTerm):
        return IndexTerm(index=term.index, right=masked(term.right), num_rows=term.num_rows)
    if isinstance(term, RoutedOuterTerm):
        return _routed_where(term, keep[term.example])
    return replace(term, left=masked(term.left), right=masked(term.right))


# From this many positions a factor's Gram is formed as three half-size blocks (two diagonal, one off-diagonal counted
# twice): 3/4 of the multiply-adds, 0.81-0.83× the time of the full T×T Gram on BERT shapes at T = 128 (#36).
_HALVED_GRAM_MIN_POSITIONS = 64


GramBlocks = tuple[tuple[torch.Tensor, float], ...]


def gram_blocks(factor: torch.Tensor) -> GramBlocks:
    """The per-example Gram F Fᵀ of a [B, T, W] factor as (block, weight) pairs whose weighted elementwise products
    with another factor's blocks sum to Σ_ij (F Fᵀ)_ij (G Gᵀ)_ij: Gram matrices are symmetric, so of the four
    half-size blocks one off-diagonal block counts twice."""
    positions = factor.shape[1]
    if positions < _HALVED_GRAM_MIN_POSITIONS:
        return ((torch.bmm(factor, factor.transpose(1, 2)), 1.0),)
    first, second = factor[:, : positions // 2], factor[:, positions // 2 :]
    return (
        (torch.bmm(first, first.transpose(1, 2)), 1.0),
        (torch.bmm(second, second.transpose(1, 2)), 1.0),
        (torch.bmm(first, second.transpose(1, 2)), 2.0),
    )


class FactorGrams:
    """The Gram blocks of the last two factors seen, reused when a term's factor is one of them.

    Consecutive weights often share a factor: Q, K and V read the same hidden states, so their input factor is one
    tensor, and between their turns comes only each one's own output-gradient factor. A factor is keyed as it was
    stored, before any cast to the accumulation dtype (under bf16 autocast the cast is made once too). A kept factor
    is referenced here, so its memory cannot be reused by another tensor while its blocks are kept: the same address,
    shape, strides and dtype then mean the same values (nothing writes to a term's factors while norms are computed).
    """

    _SLOTS = 2

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, torch.dtype, GramBlocks]] = []

    def __call__(self, factor: torch.Tensor, dtype: torch.dtype | None = None) -> GramBlocks:
        """The blocks of `factor` cast to `dtype` (its own by default)."""
        dtype = dtype or factor.dtype
        for i, (kept, kept_dtype, blocks) in enumerate(self._kept):
            if (
                kept_dtype == dtype
                and kept.data_ptr() == factor.data_ptr()
                and kept.shape == factor.shape
                and kept.stride() == factor.stride()
                and kept.dtype == factor.dtype
                and kept.device == factor.device
            ):
                self._kept.append(self._kept.pop(i))  # the most recently used is kept longest
                return blocks
        blocks = gram_blocks(factor.to(dtype))
        self._kept = [*self._kept, (factor, dtype, blocks)][-self._SLOTS :]
        return blocks


def squared_norm(term, grams: FactorGrams | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """‖g_b‖² for every example b, in one pass and without the O(B·P·D) tensor where avoidable, computed in `dtype`
    (the term's own by default). `grams`: Gram blocks shared with the other terms of the same chunk (`FactorGrams`)."""
    if isinstance(term, RoutedOuterTerm):
        return _routed_squared_norm(cast_term(term, dtype) if dtype is not None else term)
    if isinstance(term, SampleTerm):
        return _sample_squared_norm(term.grad, dtype or term.grad.dtype)
    if not isinstance(term, OuterTerm):
        return _index_squared_norm(cast_term(term, dtype) if dtype is not None else term)
    grams = grams or FactorGrams()
    parts = []  # one per Gram block pair; there is at least one
    for (left, weight), (right, _) in zip(grams(term.left, dtype), grams(term.right, dtype)):
        part = (left * right).flatten(1).sum(1)
        parts.append(part * weight if weight != 1.0 else part)
    return functools.reduce(operator.add, parts)


# Squares of an instantiated term are formed this many values at a time: `grad.pow(2).sum(1)` over a whole [B, P, D]
# gradient writes and reads a temporary as large (Mixtral-shaped, T = 512: 0.7 GB a step); blocks of it stay in cache.
# Measured on [4, 16.4M] fp32 (2 threads): 0.019-0.026 s against 0.156-0.182 s, and 4e-8 against 1e-7 relative
# error (the blocks' sums added in float64). A BLAS dot (einsum "bi,bi->b") or vector_norm is fast but off by 3e-2
# and 1e-3.
_SQUARE_BLOCK = 1 << 20


def _sample_squared_norm(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """‖g_b‖² per example of an instantiated [B, ...] gradient, squared block by block, summed in float64."""
    flat = grad.flatten(1)
    width = max(1, _SQUARE_BLOCK // max(flat.shape[0], 1))
    total = flat.new_zeros(flat.shape[0], dtype=torch.float64)
    for start in range(0, flat.shape[1], width):
        total += flat[:, start : start + width].to(dtype).pow(2).sum(1)
    return total.to(dtype)


def _index_row_sums(term: IndexTerm) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows each example touches, summed over its tokens: (example·num_rows + row keys [U], row sums [U, D])."""
    batch, _, width = term.right.shape
    example = torch.arange(batch, device=term.index.device).unsqueeze(1).expand_as(term.index)
    keys = (example * term.num_rows + term.index).reshape(-1)
    unique_keys, inverse = torch.unique(keys, return_inverse=True)
    row_sums = term.right.new_zeros(unique_keys.numel(), width).index_add_(0, inverse, term.right.reshape(-1, width))
    return unique_keys, row_sums


def _index_squared_norm(term: IndexTerm) -> torch.Tensor:
    """Sum the rows each example touches (one scatter over (example, token) keys): O(B·T·D), no T²."""
    unique_keys, row_sums = _index_row_sums(term)
    out = term.right.new_zeros(term.batch_size)
    return out.index_add_(0, unique_keys // term.num_rows, row_sums.pow(2).sum(1))


def inner(a, b) -> torch.Tensor:
    """⟨g_b^a, g_b^b⟩ per example for two terms of the same parameter (needed only for shared parameters)."""

    def rank(term) -> int:
        return 0 if isinstance(term, SampleTerm) else 1 if isinstance(term, IndexTerm) else 2

    if isinstance(a, RoutedOuterTerm) or isinstance(b, RoutedOuterTerm):
        return _routed_inner(a, b)
    if rank(a) > rank(b):
        a, b = b, a
    if isinstance(a, SampleTerm):
        return _inner_sample(a, b)
    if isinstance(a, IndexTerm) and isinstance(b, IndexTerm):
        same_row = (a.index.unsqueeze(2) == b.index.unsqueeze(1)).to(a.right.dtype)
        return (same_row * torch.bmm(a.right, b.right.transpose(1, 2))).flatten(1).sum(1)
    if isinstance(a, IndexTerm):  # b is an OuterTerm whose left factor lives in row space
        picked = b.left.gather(2, a.index.unsqueeze(1).expand(-1, b.left.shape[1], -1))  # [B, S, T]
        return (picked * torch.bmm(b.right, a.right.transpose(1, 2))).flatten(1).sum(1)
    gram_left = torch.bmm(a.left, b.left.transpose(1, 2))
    return (gram_left * torch.bmm(a.right, b.right.transpose(1, 2))).flatten(1).sum(1)


def _inner_sample(a: SampleTerm, b) -> torch.Tensor:
    if isinstance(b, SampleTerm):
        return (a.grad * b.grad).flatten(1).sum(1)
    if isinstance(b, IndexTerm):
        rows = a.grad[torch.arange(a.batch_size, device=b.index.device).unsqueeze(1), b.index]  # [B, T, D]
        return (rows * b.right).flatten(1).sum(1)
    return torch.einsum("bpd,btp,btd->b", a.grad, b.left, b.right)


def clipped_sum(term, factors: torch.Tensor, shape: torch.Size, out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_b factors[b]·g_b, formed from the stored term with one contraction and added into `out` if given.

    Accumulating in place matters for embeddings: a fresh vocabulary-sized zero tensor per chunk costs more
    than the scatter itself.
    """
    if isinstance(term, SampleTerm):
        if out is None:
            return torch.tensordot(factors, term.grad, dims=1)
        out.view(-1).addmv_(term.grad.reshape(term.batch_size, -1).t(), factors)
        return out
    if isinstance(term, IndexTerm):
        width = term.right.shape[2]
        scaled = (term.right * factors.view(-1, 1, 1)).reshape(-1, width)
        out = scaled.new_zeros(shape) if out is None else out
        return out.index_add_(0, term.index.reshape(-1), scaled)
    if isinstance(term, RoutedOuterTerm):
        return _routed_clipped_sum(term, factors, shape, out)
    # One GEMM over all (example, position) rows, as autograd's own weight gradient would be; a packed term's over
    # its examples' own tokens.
    per_row = factors.view(-1, 1).expand(term.left.shape[:2])
    if isinstance(term, PackedOuterTerm):
        left, right, per_row = term.left[term.real], term.right[term.real], per_row[term.real]
    else:
        left, right, per_row = term.left.flatten(0, 1), term.right.flatten(0, 1), per_row.reshape(-1)
    if left.shape[1] <= right.shape[1]:  # scale the narrower factor
        left = left * per_row.unsqueeze(1)
    else:
        right = right * per_row.unsqueeze(1)
    if out is None:
        return torch.mm(left.t(), right).reshape(shape)
    out.view(left.shape[1], right.shape[1]).addmm_(left.t(), right)
    return out


# ---------------------------------------------------------------- dtypes
def accumulation_dtype(param: torch.Tensor) -> torch.dtype:
    """Norms, cross terms and sums of a parameter's terms: its dtype promoted to at least float32 (never bf16)."""
    return torch.promote_types(param.dtype, torch.float32)


def cast_term(term, dtype: torch.dtype):
    """The term with its floating-point tensors in `dtype` (index tensors untouched)."""
    return type(term)(
        **{k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in vars(term).items()}
    )


# ---------------------------------------------------------------- one parameter's terms together
def combined_squared_norm(terms: list, dtype: torch.dtype, grams: FactorGrams | None = None) -> torch.Tensor:
    """‖Σ_i g_b^i‖² per example over all terms of one parameter, cross terms included, computed in `dtype`."""
    grams = grams or FactorGrams()
    total = functools.reduce(operator.add, (squared_norm(t, grams, dtype) for t in terms))
    terms = [cast_term(t, dtype) for t in terms] if len(terms) > 1 else terms
    for i in range(len(terms)):
        for j in range(i + 1, len(terms)):
            total = total + 2 * inner(terms[i], terms[j])
    return total


def instantiate(term) -> torch.Tensor:
    """The per-example gradient itself, [B, rows, ...]: B·p·d values, so only for what has no cheaper form."""
    if isinstance(term, SampleTerm):
        return term.grad
    if isinstance(term, IndexTerm):
        batch, _, width = term.right.shape
        out = term.right.new_zeros(batch, term.num_rows, width)
        return out.scatter_add_(1, term.index.unsqueeze(2).expand(-1, -1, width), term.right)
    if isinstance(term, RoutedOuterTerm):
        # Written once: each (example, expert) with pairs by its GEMM, only those without pairs zeroed.
        out = term.left.new_empty(term.examples, term.experts, term.left.shape[1], term.right.shape[1])
        unwritten = torch.ones(term.examples, term.experts, dtype=torch.bool)
        for example, expert, left, right in _routed_segments(term):
            torch.mm(left.t(), right, out=out[example, expert])
            unwritten[example, expert] = False
        for example, expert in unwritten.nonzero().tolist():
            out[example, expert].zero_()
        return out
    return torch.einsum("btp,btd->bpd", term.left, term.right)


def select_examples(term, start: int, stop: int):
    """The term restricted to examples [start, stop)."""
    if isinstance(term, RoutedOuterTerm):
        stop = min(stop, term.examples)
        kept = (term.example >= start) & (term.example < stop)
        return replace(
            term,
            left=term.left[kept],
            right=term.right[kept],
            example=term.example[kept] - start,
            expert=term.expert[kept],
            examples=max(stop - start, 0),
        )
    return type(term)(**{k: (v[start:stop] if torch.is_tensor(v) else v) for k, v in vars(term).items()})


# Per-example gradients instantiated for an L1 norm or an abs sum are formed this many values at a time: a block that
# stays in cache (4 MiB in fp32) is 4-5x faster than a 128 MiB one (measured: 32 examples, T=36, 1536x384 weight,
# one thread: 0.028 s against 0.130 s; autograd's own weight gradient takes 0.014 s).
_INSTANTIATE_BLOCK = 1 << 20


def combined_l1_norm(terms: list, dtype: torch.dtype, block_elements: int = _INSTANTIATE_BLOCK) -> torch.Tensor:
    """‖Σ_i g_b^i‖₁ per example over all terms of one parameter, computed in `dtype`.

    An L1 norm has no factored (ghost) form: a lone sampled term is read directly, a lone embedding term through
    the rows each example touches (O(B·T·D)); anything else is instantiated, a block of examples at a time so that
    no more than about `block_elements` values are held at once (a tied vocabulary-sized weight: one example).
    """
    terms = [cast_term(t, dtype) for t in terms]
    if len(terms) == 1 and isinstance(terms[0], SampleTerm):
        return terms[0].grad.flatten(1).abs().sum(1)
    if len(terms) == 1 and isinstance(terms[0], IndexTerm):
        unique_keys, row_sums = _index_row_sums(terms[0])
        out = row_sums.new_zeros(terms[0].batch_size)
        return out.index_add_(0, unique_keys // terms[0].num_rows, row_sums.abs().sum(1))
    out = torch.zeros(terms[0].batch_size, dtype=dtype, device=next(vars_tensors(terms)).device)
    for start, dense in _instantiated_blocks(terms, block_elements):
        out[start : start + dense.shape[0]] = dense.abs().sum(1)
    return out


def clipped_abs_sum(
    terms: list,
    factors: torch.Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    block_elements: int = _INSTANTIATE_BLOCK,
) -> torch.Tensor:
    """Σ_b factors[b]·abs(Σ_i g_b^i) per coordinate over all terms of one parameter, in `dtype`, added into `out`.

    The absolute value of each example's gradient has no factored form, so, as in `combined_l1_norm`: a lone sampled
    term is read directly, a lone embedding term through the rows each example touches (O(B·T·D)), anything else
    is instantiated a block of examples at a time (about `block_elements` values held at once). `factors` must be
    finite and every term's examples finite where their factor is non-zero (0·NaN is NaN: see `zero_examples`).
    """
    terms = [cast_term(t, dtype) for t in terms]
    factors = factors.to(dtype)
    if out is None:
        out = torch.zeros(shape, dtype=dtype, device=factors.device)
    flat = out.view(-1)
    if len(terms) == 1 and isinstance(terms[0], SampleTerm):
        grad = terms[0].grad
        flat.addmv_(grad.reshape(grad.shape[0], -1).abs().t(), factors)
        return out
    if len(terms) == 1 and isinstance(terms[0], IndexTerm):
        term = terms[0]
        unique_keys, row_sums = _index_row_sums(term)
        scaled = row_sums.abs() * factors[unique_keys // term.num_rows].unsqueeze(1)
        out.view(term.num_rows, -1).index_add_(0, unique_keys % term.num_rows, scaled)
        return out
    for start, dense in _instantiated_blocks(terms, block_elements):
        flat.addmv_(dense.abs().t(), factors[start : start + dense.shape[0]])
    return out


def _instantiated_blocks(terms: list, block_elements: int):
    """(first example, [examples, values]) blocks of Σ_i g_b^i instantiated, about `block_elements` values each (at
    least one example)."""
    step = max(1, block_elements // max(max(_numel_per_example(t) for t in terms), 1))
    for start in range(0, terms[0].batch_size, step):
        block = [select_examples(t, start, start + step) for t in terms]
        yield start, sum(instantiate(t).reshape(block[0].batch_size, -1) for t in block)


def vars_tensors(terms: list):
    """The floating-point tensors the terms hold."""
    for term in terms:
        yield from (v for v in vars(term).values() if torch.is_tensor(v) and v.is_floating_point())


def _numel_per_example(term) -> int:
    if isinstance(term, SampleTerm):
        return term.grad[0].numel() if term.batch_size else 0
    if isinstance(term, IndexTerm):
        return term.num_rows * term.right.shape[2]
    if isinstance(term, RoutedOuterTerm):
        return term.experts * term.left.shape[1] * term.right.shape[1]
    return term.left.shape[2] * term.right.shape[2]


# ---------------------------------------------------------------- masks (applied to every example's gradient)
def _keep(selection, size: int, device: torch.device) -> torch.Tensor:
    """A [size] bool mask, False where `selection` (indices, or a bool mask with True = zeroed) points."""
    selection = torch.as_tensor(selection, device=device)
    if selection.dtype == torch.bool:
        if selection.shape != (size,):
            raise ValueError(f"A boolean mask must have shape ({size},), got {tuple(selection.shape)}.")
        return ~selection
    keep = torch.ones(size, dtype=torch.bool, device=device)
    keep[selection.long().reshape(-1)] = False
    return keep


def _where(keep: torch.Tensor, values: torch.Tensor, dim: int) -> torch.Tensor:
    """`values` with exact zeros where `keep` (indexing dimension `dim` of `values`) is False."""
    shape = [1] * values.dim()
    shape[dim] = keep.numel()
    return torch.where(keep.view(shape), values, values.new_zeros(()))


def zero_rows(term, rows):
    """The term whose every example's gradient has rows `rows` (dimension 0 of the parameter) set to exactly zero.

    `rows`: indices, or a bool mask over the parameter's first dimension (True = zeroed). Nothing B×p×d is formed:
    a factored weight term loses the rows of its left factor (Linear: output features; GPT-2 Conv1D: input
    features, its weight being [in, out]), an embedding term the positions that look up a masked row, a sampled
    term the rows themselves (a bias or norm gain: the coordinates).
    """
    if isinstance(term, SampleTerm):
        return SampleTerm(_where(_keep(rows, term.grad.shape[1], term.grad.device), term.grad, 1))
    if isinstance(term, IndexTerm):
        keep = _keep(rows, term.num_rows, term.index.device)[term.index]  # [B, T]: the token's row is kept
        right = torch.where(keep.unsqueeze(2), term.right, term.right.new_zeros(()))
        return IndexTerm(index=term.index, right=right, num_rows=term.num_rows)
    if isinstance(term, RoutedOuterTerm):  # dimension 0 of stacked expert weights: the experts
        return _routed_where(term, _keep(rows, term.experts, term.expert.device)[term.expert])
    keep = _keep(rows, term.left.shape[2], term.left.device)
    return OuterTerm(left=_where(keep, term.left, 2), right=term.right)


def zero_columns(term, columns):
    """The term whose every example's gradient has columns `columns` (dimension 1 of a 2-D parameter) set to zero.

    `columns`: indices, or a bool mask over the parameter's second dimension (True = zeroed). A factored weight term
    loses the columns of its right factor (Linear: input features), an embedding term the columns of its rows.
    """
    if isinstance(term, SampleTerm):
        if term.grad.dim() < 3:
            raise ValueError("zero_columns needs a parameter with at least two dimensions; use zero_rows for a vector.")
        return SampleTerm(_where(_keep(columns, term.grad.shape[2], term.grad.device), term.grad, 2))
    if isinstance(term, IndexTerm):
        keep = _keep(columns, term.right.shape[2], term.right.device)
        return IndexTerm(index=term.index, right=_where(keep, term.right, 2), num_rows=term.num_rows)
    if isinstance(term, RoutedOuterTerm):  # dimension 1 of stacked expert weights: each expert's output features
        return replace(term, left=_where(_keep(columns, term.left.shape[1], term.left.device), term.left, 1))
    keep = _keep(columns, term.right.shape[2], term.right.device)
    return OuterTerm(left=term.left, right=_where(keep, term.right, 2))


# ---------------------------------------------------------------- routed terms (a mixture of experts' expert weights)
def _routed_where(term: RoutedOuterTerm, keep: torch.Tensor) -> RoutedOuterTerm:
    """The term with the pairs outside `keep` (a [S] bool mask) contributing exactly zero."""
    return replace(term, left=_where(keep, term.left, 0), right=_where(keep, term.right, 0))


def _pairs_by_expert(term: RoutedOuterTerm):
    """(expert, indices of its pairs) for every expert that at least one pair was routed to."""
    order = torch.argsort(term.expert, stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(term.expert, minlength=term.experts).tolist()):
        if count:
            yield expert, order[start : start + count]
        start += count


def _routed_segments(term: RoutedOuterTerm):
    """(example, expert, left [n, P], right [n, D]) for every (example, expert) with n ≥ 1 pairs routed to it: the
    pairs of one example's gradient of one expert, unpadded. The experts' rule orders its pairs by expert, then token,
    so they already lie in contiguous slices and nothing is gathered; any other order is sorted first."""
    key = term.expert * term.examples + term.example
    left, right = term.left, term.right
    if key.numel() > 1 and not bool((key[1:] >= key[:-1]).all()):
        order = torch.argsort(key, stable=True)
        key, left, right = key[order], left[order], right[order]
    start = 0
    for segment, count in enumerate(torch.bincount(key, minlength=term.experts * term.examples).tolist()):
        if count:
            expert, example = divmod(segment, term.examples)
            yield example, expert, left[start : start + count], right[start : start + count]
        start += count


def routed_outer_term(
    left: torch.Tensor,
    right: torch.Tensor,
    example: torch.Tensor,
    expert: torch.Tensor,
    examples: int,
    experts: int,
) -> RoutedOuterTerm | SampleTerm:
    """Keep an expert weight's pairs factored for the ghost norm, or instantiate its [B, E, P, D] per-example gradients
    now, by `outer_product_term`'s rule with an example's mean pairs per expert as the sequence length. Instantiated,
    the norm is one pass and the clipped sum a weighted sum over examples, where the factored clipped sum would run
    the GEMMs again (Mixtral-shaped, T = 512: 256 pairs per example and expert, 2048×512 and 512×1024 experts)."""
    term = RoutedOuterTerm(left=left, right=right, example=example, expert=expert, examples=examples, experts=experts)
    pairs_per_segment = -(-left.shape[0] // max(examples * experts, 1))
    if ghost_norm_is_cheaper(pairs_per_segment, left.shape[1], right.shape[1]):
        return term
    return SampleTerm(instantiate(term))


def _routed_squared_norm(term: RoutedOuterTerm) -> torch.Tensor:
    """Σ_e ‖g_b[e]‖²: per (example, expert) the ghost norm Σ_{s,t} (l_s·l_t)(r_s·r_t) over its pairs, or its [P, D]
    gradient formed for a moment where that is cheaper (`ghost_norm_is_cheaper`)."""
    out = term.left.new_zeros(term.examples)
    for example, _, left, right in _routed_segments(term):
        if ghost_norm_is_cheaper(left.shape[0], left.shape[1], right.shape[1]):
            out[example] += ((left @ left.t()) * (right @ right.t())).sum()
        else:
            out[example] += (left.t() @ right).pow(2).sum()
    return out


def _routed_inner(a, b) -> torch.Tensor:
    """⟨g_b^a, g_b^b⟩ when one term is routed: per (example, expert), against a routed or an instantiated term."""
    if not isinstance(a, RoutedOuterTerm):
        a, b = b, a
    out = a.left.new_zeros(a.examples)
    if isinstance(b, SampleTerm):  # grad [B, E, P, D]
        for example, expert, left, right in _routed_segments(a):
            out[example] += ((left @ b.grad[example, expert]) * right).sum()
        return out
    if not isinstance(b, RoutedOuterTerm):
        raise TypeError(
            f"inner: a {type(b).__name__} and a RoutedOuterTerm cannot be terms of one parameter (stacked expert "
            "weights [experts, P, D] get routed or instantiated terms only)."
        )
    other = {(example, expert): (left, right) for example, expert, left, right in _routed_segments(b)}
    for example, expert, left, right in _routed_segments(a):
        if (example, expert) in other:
            left_b, right_b = other[example, expert]
            out[example] += ((left @ left_b.t()) * (right @ right_b.t())).sum()
    return out


def _routed_clipped_sum(
    term: RoutedOuterTerm, factors: torch.Tensor, shape: torch.Size, out: torch.Tensor | None
) -> torch.Tensor:
    """Σ_b factors[b]·g_b: one GEMM per expert over the pairs routed to it, each pair scaled by its example's
    factor, as autograd's own expert weight gradient is one GEMM per expert."""
    out = term.left.new_zeros(shape) if out is None else out
    scale = factors[term.example].unsqueeze(1)
    for expert, pairs in _pairs_by_expert(term):
        left, right = term.left[pairs], term.right[pairs]
        if left.shape[1] <= right.shape[1]:  # scale the narrower factor
            left = left * scale[pairs]
        else:
            right = right * scale[pairs]
        out[expert].addmm_(left.t(), right)
    return out
