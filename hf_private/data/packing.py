"""Padding-free packing: a chunk's examples laid end to end in one row, each still one privacy unit.

A packing collator (`DataCollatorWithFlattening`, TRL's `padding_free=True`) concatenates the chunk's examples into
one row whose `position_ids` restart at 0 at every example. Nothing is computed for padding, and nothing about privacy
changes: the sampler still draws examples, and the engine still clips each example's own gradient, because an
example's gradient on a layer is a sum over its own tokens (`engine.recording(packed=lengths)` regathers each layer's
tokens one example per row before any norm). Attention must not cross examples: transformers builds the block-diagonal
mask from the restarting `position_ids` for causal LMs (no attention mask, no cache) and flash-attention kernels read
`cu_seq_lens`; the trainer's independence probe checks the result on packed chunks as on padded ones.

Here: recognising a packed chunk (`packed_lengths`: each example's tokens, checked against the number of examples the
collator was given), its examples' lengths carried beside the batch (`PACKED_LENGTHS_KEY`), how a packed chunk runs
(`packed_pieces`: forwards of at most a chunk of whole units, each laid out as rows of whole units of at most
`packed_row_tokens` tokens, since SDPA and eager attention compute a row densely; `lay_out_rows` pads the rows to the
longest, the padding a segment of its own that no example attends to; `PackedLayout` says where every token lies),
slicing a packed chunk by examples (`slice_packed`, which recomputes the boundaries flash kernels read), and
`PackedClassificationCollator` for sentence classifiers (one label per sentence).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..models.peft import unwrap_peft

#: the collated batch's entry listing, in order, how many tokens each packed example has (never reaches the model)
PACKED_LENGTHS_KEY = "packed_example_lengths"
#: a packed chunk laid out as several rows (`lay_out_rows`): how many examples each row holds, in order (never reaches
#: the model); without it a packed chunk is one row
PACKED_ROWS_KEY = "packed_row_examples"
#: boundary entries packing collators add for varlen attention kernels, recomputed when a packed chunk is sliced
_BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def packed_lengths(batch: Mapping[str, Any], num_examples: int) -> torch.Tensor | None:
    """Each example's token count if `batch` packs `num_examples` examples into one row (position_ids restarting at
    0 at each, nothing else in the row), else None (the batch is then checked as one row per example).

    Refused: a packed row whose restarts do not count exactly the examples collated (padding in the row, an example
    split over rows or merged with another), several packed rows, and an attention mask beside packed positions (it
    would stop transformers building the block-diagonal mask, and examples would attend to each other).
    """
    positions = batch.get("position_ids")
    if not torch.is_tensor(positions) or positions.dim() != 2:
        return None
    if positions.shape[0] == num_examples and not any(key in batch for key in _BOUNDARIES):
        return None  # one row per example, checked by the caller
    starts = positions == 0
    if positions.shape[0] != 1:
        raise ValueError(
            f"The packed batch has {positions.shape[0]} rows: hf_private packs a chunk into one row (each example "
            "whole). Use DataCollatorWithFlattening or TRL's padding_free=True without packing=True."
        )
    if "attention_mask" in batch:
        raise ValueError(
            "The packed batch carries an attention_mask: transformers then does not build the block-diagonal mask "
            "from the restarting position_ids, and packed examples would attend to each other. Drop the "
            "attention_mask from packed batches (DataCollatorWithFlattening and TRL's padding_free do)."
        )
    row = positions[0]
    boundaries = torch.cat([starts[0].nonzero().flatten(), torch.tensor([row.numel()], device=row.device)])
    lengths = boundaries.diff()
    contiguous = torch.equal(row, torch.cat([torch.arange(int(n), device=row.device) for n in lengths]))
    if not bool(starts[0, 0]) or not contiguous or lengths.numel() != num_examples:
        raise ValueError(
            f"The packed row holds {lengths.numel()} runs of position_ids restarting at 0 for {num_examples} "
            "examples collated: each example must be one run 0, 1, 2, … of its own, whole. Packing that splits an "
            "example over rows (TRL packing=True with 'wrapped' or 'bfd_split'), pads the row (pad_to_multiple_of) "
            "or merges examples breaks per-example clipping. Use DataCollatorWithFlattening or TRL's "
            "padding_free=True."
        )
    return lengths.cpu()


class PackedClassificationCollator:
    """Packs sentences for a sequence classifier: input_ids end to end in one row with position_ids restarting at 0,
    and one label per sentence (`DataCollatorWithFlattening` makes token labels, for language models). For
    hf_private's mean-pooled heads, which attend within each sentence and pool each alone when they see such a row;
    any other key of the features (attention_mask, token_type_ids, text columns) is dropped."""

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(feature["input_ids"], dtype=torch.long) for feature in features]
        if any(row.dim() != 1 or row.numel() == 0 for row in ids):
            raise ValueError("PackedClassificationCollator needs every feature's input_ids as one non-empty sequence.")
        batch = {
            "input_ids": torch.cat(ids)[None],
            "position_ids": torch.cat([torch.arange(row.numel()) for row in ids])[None],
        }
        key = "labels" if "labels" in features[0] else "label" if "label" in features[0] else None
        if key is not None:
            labels = [feature[key] for feature in features]
            batch["labels"] = torch.tensor(labels, dtype=torch.float if isinstance(labels[0], float) else torch.long)
        return batch


#: Under masked attention (eager, SDPA: a row's attention is computed densely, O(width²)) a packed chunk runs as rows
#: of at most this many tokens by default, several rows to a forward, padded to the widest, with at most
#: PACKED_FORWARD_TOKENS padded tokens a forward. Measured on SST-2 / all-MiniLM-L6-v2, one CPU thread
#: (docs/benchmarks.md, "Padding-free packing against padded chunks"): rows of 32 in forwards of 256 tokens
#: 13.0 ms an example, rows of 128 one to a forward 14.3, a chunk's rows of 128 in one forward 14.9 (its larger
#: working set ran slower).
PACKED_ROW_TOKENS = 32
PACKED_FORWARD_TOKENS = 256
#: attention implementations that read the 4-D mask transformers builds (or a head passes): several packed rows can
#: share a forward, each row's examples and padding kept apart by the mask. Varlen kernels (flash attention) read
#: packed boundaries only for a batch of one row, so there each row runs alone.
_MASKED_ATTENTION = ("eager", "sdpa")


def check_packing_tokens(row_tokens: Any, forward_tokens: Any) -> tuple[int | str | None, int | None]:
    """`packed_row_tokens` (an int >= 1, None: a chunk in one row, or "auto") and `packed_forward_tokens` (an int >= 1
    or None: a chunk's rows in one forward) as given."""
    for name, value, allowed in (
        ("packed_row_tokens", row_tokens, (None, "auto")),
        ("packed_forward_tokens", forward_tokens, (None,)),
    ):
        if value not in allowed and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1{''.join(f' or {a!r}' for a in allowed)}, got {value!r}.")
    return row_tokens, forward_tokens


def rows_share_a_forward(model: nn.Module) -> bool:
    """Whether the model's attention keeps packed rows of one batch apart by a mask (eager, SDPA)."""
    return getattr(unwrap_peft(model).config, "_attn_implementation", None) in _MASKED_ATTENTION


def packed_shape(
    model: nn.Module, row_tokens: int | str | None, forward_tokens: int | None
) -> tuple[int | None, int | None]:
    """(tokens a row, padded tokens a forward) of the model's packed chunks. "auto" rows: PACKED_ROW_TOKENS under
    masked attention, one row a chunk under varlen kernels, which attend within each example whatever the row's
    length. Varlen kernels take one row a forward."""
    masked = rows_share_a_forward(model)
    if isinstance(row_tokens, str):  # "auto", the one string `check_packing_tokens` lets through
        return PACKED_ROW_TOKENS if masked else None, forward_tokens if masked else 0
    return row_tokens, forward_tokens if masked else 0


def packed_pieces(
    unit_sizes: Sequence[int],
    lengths: torch.Tensor,
    units_per_piece: int,
    row_tokens: int | None,
    forward_tokens: int | None = None,
) -> Iterator[tuple[int, int, list[int], list[int]]]:
    """(first example, end example, examples of each unit, examples of each row) of each forward of a packed chunk:
    at most `units_per_piece` whole units, in order, laid out as rows of whole units of at most `row_tokens` tokens
    (a longer unit alone in its row; None: one row), and at most `forward_tokens` tokens once every row is padded to
    the widest (a row wider than that alone; None: no bound; 0: every row a forward of its own)."""
    tokens = [int(n) for n in lengths.tolist()]
    start = example = used = widest = 0
    units: list[int] = []
    rows: list[int] = []
    for size in (int(n) for n in unit_sizes):
        unit_tokens = sum(tokens[example : example + size])
        new_row = not rows or (row_tokens is not None and used + unit_tokens > row_tokens)
        width = unit_tokens if new_row else used + unit_tokens
        padded = (len(rows) + new_row) * max(widest, width)
        too_wide = forward_tokens is not None and (new_row if forward_tokens == 0 else padded > forward_tokens)
        if units and (len(units) == units_per_piece or too_wide):
            yield start, example, units, rows
            start, units, rows, new_row, widest = example, [], [], True, 0
        if new_row:
            rows.append(0)
            used = 0
        rows[-1] += size
        used += unit_tokens
        widest = max(widest, used)
        units.append(size)
        example += size
    if units:
        yield start, example, units, rows


class PackedLayout:
    """Where a packed chunk's tokens lie: its examples (`lengths` tokens each) end to end in rows of `row_examples`
    examples each (None: one row), every row padded to the longest (`width`)."""

    def __init__(self, lengths: Sequence[int] | torch.Tensor, row_examples: Sequence[int] | None = None) -> None:
        self.lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if self.lengths.dim() != 1 or not bool((self.lengths > 0).all()):
            raise ValueError(f"Packed examples need one length >= 1 each, got {self.lengths.tolist()}.")
        examples = self.lengths.numel()
        self.row_examples = tuple(int(n) for n in row_examples) if row_examples is not None else (examples,)
        if sum(self.row_examples) != examples or min(self.row_examples, default=1) < 1:
            raise ValueError(
                f"Packed rows of {list(self.row_examples)} examples do not hold the chunk's {examples} "
                "examples, each row at least one."
            )
        self.row_tokens = [int(part.sum()) for part in torch.split(self.lengths, list(self.row_examples))]
        self.rows, self.width, self.tokens = len(self.row_examples), max(self.row_tokens), int(self.lengths.sum())
        self._token_index: dict[torch.device, torch.Tensor] = {}  # read by every token tensor and layer of a chunk

    @property
    def examples(self) -> int:
        return self.lengths.numel()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is laid out as the rows: [rows, width, ...]."""
        return tensor.dim() >= 2 and tuple(tensor.shape[:2]) == (self.rows, self.width)

    def token_index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Where every example's tokens lie in the rows flattened to [rows · width], examples in order."""
        device = torch.device(device)
        if device not in self._token_index:
            self._token_index[device] = torch.cat(
                [
                    torch.arange(row * self.width, row * self.width + n, device=device)
                    for row, n in enumerate(self.row_tokens)
                ]
            )
        return self._token_index[device]

    def owner(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[rows, width]: each token's example, -1 for padding."""
        owner = torch.full((self.rows * self.width,), -1, dtype=torch.long, device=device)
        owner[self.token_index(device)] = torch.repeat_interleave(
            torch.arange(self.examples, device=device), self.lengths.to(device)
        )
        return owner.view(self.rows, self.width)


def lay_out_rows(batch: Mapping[str, Any], row_examples: Sequence[int], mask_padding: bool) -> dict[str, Any]:
    """A packed chunk in one row as rows of `row_examples` examples each, padded to the longest row.

    A row's padding (input id 0, labels -100) sits at position 0, every padding token a segment of its own that no
    example attends to, at a position every model has: a causal LM's block-diagonal mask separates it by the
    restarting position_ids, and with `mask_padding` (a mean-pooled head, which reads an attention_mask beside packed
    positions) an attention_mask marks it 0. Varlen boundary entries describe one row and are dropped: rows share a
    forward only under masked attention.
    """
    if len(row_examples) == 1:
        return dict(batch)
    layout = PackedLayout(batch[PACKED_LENGTHS_KEY], row_examples)
    laid: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _BOUNDARIES:
            continue
        if _is_token_row(value, layout.tokens):
            rows = value.new_full((layout.rows * layout.width, *value.shape[2:]), -100 if key == "labels" else 0)
            rows[layout.token_index(value.device)] = value[0]
            laid[key] = rows.view(layout.rows, layout.width, *value.shape[2:])
        else:
            laid[key] = value
    laid[PACKED_ROWS_KEY] = torch.tensor(list(row_examples))
    if mask_padding:
        laid["attention_mask"] = (layout.owner() >= 0).long().to(batch[PACKED_LENGTHS_KEY].device)
    return laid


def _is_token_row(value: Any, tokens: int) -> bool:
    """A tensor laid out along a packed row's tokens: [1, tokens, ...]."""
    return torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == tokens


def packs(collate: Any, dataset: Any) -> bool:
    """Whether `collate` (the trainer's empty-safe collator) packs: two examples of `dataset` collated as a trial."""
    return PACKED_LENGTHS_KEY in collate([dataset[0], dataset[1]])


def packed_examples(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The packed examples' token counts of a collated batch (None if it is not packed)."""
    lengths = batch.get(PACKED_LENGTHS_KEY)
    return lengths if torch.is_tensor(lengths) else None


def packed_layout(batch: Mapping[str, Any]) -> PackedLayout | None:
    """Where a packed batch's examples lie (None if it is not packed)."""
    lengths = packed_examples(batch)
    if lengths is None:
        return None
    rows = batch.get(PACKED_ROWS_KEY)
    return PackedLayout(lengths, rows.tolist() if torch.is_tensor(rows) else None)


def slice_packed(batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Examples start:stop of a packed batch, as a packed batch of their own in one row (their tokens, per-example
    entries such as a sentence's label, and boundaries)."""
    if PACKED_ROWS_KEY in batch:
        batch = _one_row(batch)
    lengths = batch[PACKED_LENGTHS_KEY].cpu()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    first, last = int(offsets[start]), int(offsets[stop])
    part = lengths[start:stop]
    tokens = int(offsets[-1])
    sliced: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _BOUNDARIES:
            continue
        if _is_token_row(value, tokens):
            sliced[key] = value[:, first:last]
        elif torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == lengths.numel():
            sliced[key] = value[start:stop]  # one entry per example (a sentence's label)
        else:
            sliced[key] = value
    sliced[PACKED_LENGTHS_KEY] = part
    sliced.update(_boundaries(batch, part))
    return sliced


def _one_row(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk laid out by `lay_out_rows` back in one row: its examples' tokens end to end, no padding."""
    layout = PackedLayout(batch[PACKED_LENGTHS_KEY], batch[PACKED_ROWS_KEY].tolist())
    row: dict[str, Any] = {}
    for key, value in batch.items():
        if key in (PACKED_ROWS_KEY, "attention_mask"):
            continue
        if torch.is_tensor(value) and layout.holds(value):
            row[key] = value.flatten(0, 1).index_select(0, layout.token_index(value.device))[None]
        else:
            row[key] = value
    return row


def _boundaries(batch: Mapping[str, Any], lengths: torch.Tensor) -> dict[str, Any]:
    """The boundary entries `batch` had, recomputed for `lengths` (as TRL's padding-free collator computes them)."""
    present = [key for key in _BOUNDARIES if key in batch]
    if not present:
        return {}
    device = next(batch[key].device for key in present if torch.is_tensor(batch[key]))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    values = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "seq_idx": torch.repeat_interleave(
            torch.arange(lengths.numel(), dtype=torch.int32, device=device), lengths.to(device)
        )[None],
    }
    return {key: values[key] for key in present}
