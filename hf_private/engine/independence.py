"""Example-independence probe: no example's gradient may depend on its chunk-mates.

Hooks see which rows a gradient lands in, not what those rows were computed from. With left padding and
absolute position embeddings an example's positions depend on the longest example in its chunk; a layer with
batch statistics mixes every example. Clipping then bounds each term but not one example's influence on the
sum. So a few examples are recomputed alone (a batch of one, padding columns removed) and their gradient norms
compared with the ones they had inside a chunk: those of a real chunk, and those of a probe chunk collated from
examples of the training set spread over its lengths (`spread_by_length`). The second matters because a real
chunk may show nothing: with `group_by_length` the first chunk holds the batch's shortest examples, often all of
one length, so nothing is padded and the two computations are identical. The trainer probes again after every
stage or method switch (a new trainable set). Where a privacy unit spans several examples (a user's), units are
what is recomputed alone: the slice of a unit's examples, against the unit's norm inside the chunk. Left padding
without `position_ids` is refused on every chunk before this (`example_rows.check_one_row_per_example`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data.labels import IGNORE_INDEX
from ..data.packing import packed_examples, packed_layout, slice_packed
from ..models.support import is_seq2seq_lm
from .core import PerExampleGradientEngine
from .terms import format_sizes, unit_sizes

#: Σ_b ℓ_b for the batch given, computed however the model is set (the probe runs it in eval mode)
SummedLoss = Callable[[nn.Module, dict[str, Any]], torch.Tensor]

RTOL = 1e-3  # fp32: recomputing alone changes only summation order
RTOL_LOW_PRECISION = 5e-2  # bf16 autocast rounds the two computations differently
MAX_PROBES = 3
PROBE_EXAMPLES = 5  # a probe chunk from the training set: its shortest, longest and three quantiles of length
_LENGTH_CANDIDATES = 2048  # evenly spaced examples whose lengths are read to choose them (reading all is O(N))

_CAUSES = (
    "Likely causes: (1) left padding with absolute position embeddings (GPT-2 style), where positions count "
    "from the chunk's longest example: pad on the right, or pass position_ids derived from the attention mask "
    "(attention_mask.cumsum(-1) - 1, clamped at 0); with left padding a causal-LM label on an example's first "
    "token is also predicted from a padding position, so set it to -100; (2) several examples packed into "
    "shared rows: use DataCollatorWithPadding instead; (3) a layer that mixes examples, such as batch "
    "statistics (BatchNorm-like) or a batch-wide mean: replace it with a per-example layer (LayerNorm/GroupNorm); "
    "(4) a loss normalised over the chunk (divided by its number of examples or tokens, as TRL's num_items_in_batch): "
    "sum each unit's own loss instead."
)


def check_example_independence(
    engine: PerExampleGradientEngine,
    model: nn.Module,
    inputs: Mapping[str, Any],
    summed_loss: SummedLoss,
    num_examples: int,
    rows_per_example: int = 1,
    rtol: float = RTOL,
    examples_per_unit: Sequence[int] | None = None,
) -> None:
    """Raise if a unit's per-unit gradient norm inside `inputs` differs from its norm alone.

    `inputs` holds `num_examples` examples (the leading dimension of its per-example tensors), each of
    `rows_per_example` rows for the model. By default every example is a unit; `examples_per_unit` (one count per
    unit, summing to `num_examples`) makes each unit a run of consecutive examples (a user's), recorded with its
    examples' rows and recomputed alone as the slice of its examples. Runs in eval mode (dropout would make the two
    computations differ) and in the engine's probe mode: the clipped sums, autograd's `.grad` and the model's
    train/eval mode are left as they were.
    """
    units = _units(examples_per_unit, num_examples)
    was_training = model.training
    model.eval()
    try:
        in_batch = _norms(engine, model, dict(inputs), summed_loss, _unit_rows(units, num_examples, rows_per_example))
        finite = in_batch[torch.isfinite(in_batch)]  # a non-finite unit is dropped by the clip anyway
        floor = 1e-3 * rtol * float(finite.max()) if finite.numel() else 0.0
        for b in _probe_examples(inputs, num_examples, rows_per_example, units):
            if not torch.isfinite(in_batch[b]):
                continue
            single = example_alone(inputs, b, num_examples, rows_per_example, units, is_seq2seq_lm(model))
            size = 1 if units is None else units[b]
            alone = float(_norms(engine, model, single, summed_loss, (1, size * rows_per_example))[0])
            inside = float(in_batch[b])
            if abs(alone - inside) > rtol * max(alone, inside) + floor:
                if units is None:
                    what, mates, kind = f"Example {b} of a probed chunk", f"{num_examples - 1} chunk-mates", "example"
                else:
                    what = f"Unit {b} ({size} example{'' if size == 1 else 's'}) of a probed chunk"
                    mates, kind = f"{len(units) - 1} chunk-mate units", "unit"
                raise ValueError(
                    f"{what} has gradient norm {inside:.6g} among its {mates} but {alone:.6g} alone: its gradient "
                    f"depends on the other {kind}s, so clipping does not bound one {kind}'s influence and the privacy "
                    "guarantee would not hold. " + _CAUSES
                )
    finally:
        model.train(was_training)


def _units(examples_per_unit: Sequence[int] | None, num_examples: int) -> tuple[int, ...] | None:
    """`examples_per_unit` checked against the chunk's examples (None: every example its own unit)."""
    if examples_per_unit is None:
        return None
    units = unit_sizes(examples_per_unit)
    if sum(units) != num_examples:
        raise ValueError(
            f"examples_per_unit {format_sizes(units)} counts {sum(units)} examples, but the probed chunk "
            f"holds {num_examples}: every example must belong to exactly one unit, in order."
        )
    return units


def _unit_rows(units: tuple[int, ...] | None, num_examples: int, rows_per_example: int):
    """What `engine.recording` is told about the chunk: (units, rows per unit)."""
    if units is None:
        return num_examples, rows_per_example
    return len(units), [count * rows_per_example for count in units]


def _norms(engine, model, inputs, summed_loss, chunk) -> torch.Tensor:
    with engine.recording(*chunk, probe=True, packed=packed_layout(inputs)):
        summed_loss(model, inputs).backward()
    return engine.finish_backward()


def _mask(inputs: Mapping[str, Any], rows_per_example: int) -> torch.Tensor | None:
    """The [B, T] (multiple choice: [B, C, T]) padding mask, if the batch has one of that shape."""
    mask = inputs.get("attention_mask")
    dims = 2 if rows_per_example == 1 else 3
    return mask if torch.is_tensor(mask) and mask.dim() == dims else None


def _probe_examples(
    inputs: Mapping[str, Any], num_examples: int, rows_per_example: int, examples_per_unit: Sequence[int] | None = None
) -> list[int]:
    """The first, shortest and longest examples: the shortest has the most padding, the longest none.

    With `examples_per_unit`: the units (indices into it) of the first, shortest and longest examples, and the unit
    with the most examples.
    """
    units = _units(examples_per_unit, num_examples)
    mask = _mask(inputs, rows_per_example)
    lengths = packed_examples(inputs)
    if lengths is not None:  # packed: the examples' own token counts
        mask = torch.arange(int(lengths.max()), device=lengths.device) < lengths[:, None]
    if units is None:
        if mask is None:
            return list(dict.fromkeys([0, num_examples - 1]))[:MAX_PROBES]
        lengths = mask.reshape(num_examples, -1).ne(0).sum(1)
        return list(dict.fromkeys([0, int(lengths.argmin()), int(lengths.argmax())]))[:MAX_PROBES]
    owner = np.repeat(np.arange(len(units)), units)
    largest = int(np.argmax(units))
    if mask is None:
        picks = [0, len(units) - 1, largest]
    else:
        lengths = mask.reshape(num_examples, -1).ne(0).sum(1)
        picks = [0, int(owner[int(lengths.argmin())]), int(owner[int(lengths.argmax())]), largest]
    return list(dict.fromkeys(picks))[: MAX_PROBES + 1]


def example_alone(
    inputs: Mapping[str, Any],
    b: int,
    num_examples: int,
    rows_per_example: int = 1,
    examples_per_unit: Sequence[int] | None = None,
    seq2seq: bool = False,
) -> dict[str, Any]:
    """Example `b` (with `examples_per_unit`: unit `b`, its examples) as a batch of its own, without the columns that
    are padding in all of its rows.

    Every tensor with one entry per example (leading dimension `num_examples`) is sliced; every tensor shaped like the
    padding mask (input_ids, position_ids, token_type_ids, token labels, ...) then loses the same columns; tensors
    broadcast over the batch (leading dimension 1) are kept whole. For an encoder-decoder LM (`seq2seq`) the target
    side (labels, decoder inputs) has a width of its own, equal to the source's only by chance: it loses its trailing
    label padding instead (`_target_alone`).
    """
    units = _units(examples_per_unit, num_examples)
    if units is None:
        start, stop = b, b + 1
    else:
        start = sum(units[:b])
        stop = start + units[b]
    if packed_examples(inputs) is not None:  # a packed row holds no padding: its examples' tokens only
        return slice_packed(inputs, start, stop)
    single = {
        k: v[start:stop] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == num_examples else v
        for k, v in inputs.items()
    }
    target = {k: single.pop(k) for k in _TARGET_KEYS if k in single} if seq2seq else {}
    mask = _mask(single, rows_per_example)
    if mask is None:
        return {**single, **_target_alone(target)}
    columns = mask.reshape(-1, mask.shape[-1]).ne(0).any(0).nonzero().squeeze(1)
    axis = mask.dim() - 1
    source = {
        k: v.index_select(axis, columns) if torch.is_tensor(v) and v.shape[: mask.dim()] == mask.shape else v
        for k, v in single.items()
    }
    return {**source, **_target_alone(target)}


_TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def _target_alone(target: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder LM example's target side without the label padding (-100) after its last label: the decoder
    is causal, so only trailing columns can go without changing what its labels are predicted from."""
    labels = target.get("labels")
    if not torch.is_tensor(labels) or labels.dim() != 2 or not bool(labels.ne(IGNORE_INDEX).any()):
        return target
    width = int(labels.ne(IGNORE_INDEX).any(0).nonzero().max()) + 1
    return {k: v[:, :width] if torch.is_tensor(v) and v.shape[:2] == labels.shape else v for k, v in target.items()}


def spread_by_length(dataset: Sequence[Any], count: int = PROBE_EXAMPLES) -> list[int]:
    """Indices of up to `count` examples spread over the training set's lengths (shortest, quantiles, longest).

    Lengths are attended tokens (the attention_mask's ones, else the input_ids' entries) of evenly spaced
    candidates; examples without either are taken evenly spaced. Which examples are probed is public (a
    function of the data's layout, not of the secret sampler), and the probe releases nothing but its verdict.
    """
    size = len(dataset)
    candidates = np.unique(np.linspace(0, size - 1, min(size, _LENGTH_CANDIDATES)).round().astype(int))
    lengths = [_attended_tokens(dataset[int(i)]) for i in candidates]
    if any(length is None for length in lengths):
        return [int(i) for i in np.unique(np.linspace(0, size - 1, min(size, count)).round().astype(int))]
    by_length = candidates[np.argsort(np.asarray(lengths), kind="stable")]
    picks = np.linspace(0, len(by_length) - 1, min(len(by_length), count)).round().astype(int)
    return [int(by_length[i]) for i in dict.fromkeys(picks.tolist())]


def _attended_tokens(example: Any) -> int | None:
    if not isinstance(example, Mapping):
        return None
    for key in ("attention_mask", "input_ids"):
        if key in example:
            values = np.asarray(example[key])
            return int(values.sum()) if key == "attention_mask" else int(values.size)
    return None


def probe_example_independence(
    engine: PerExampleGradientEngine,
    model: nn.Module,
    chunks: Sequence[tuple],
    summed_loss: SummedLoss,
    low_precision: bool,
) -> None:
    """`check_example_independence` on each chunk: a real training chunk and a probe chunk of training examples spread
    over their lengths (which a length-sorted or unpadded real chunk may not show), at the tolerance the precision
    allows.

    A chunk is `(inputs, examples, rows per example)`, every example a unit, or `(inputs, examples, rows per example,
    examples_per_unit)`, each unit that many consecutive examples (None: one each); `examples` counts the examples
    (the leading dimension of the inputs' per-example tensors), not the units.
    """
    for chunk in chunks:
        if len(chunk) not in (3, 4):
            raise ValueError(
                f"A probed chunk is (inputs, examples, rows_per_example[, examples_per_unit]), got a "
                f"tuple of {len(chunk)}."
            )
        inputs, examples, rows = chunk[:3]
        check_example_independence(
            engine,
            model,
            inputs,
            summed_loss,
            examples,
            rows,
            rtol=RTOL_LOW_PRECISION if low_precision else RTOL,
            examples_per_unit=chunk[3] if len(chunk) == 4 else None,
        )
