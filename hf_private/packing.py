"""Padding-free packing: a chunk's examples laid end to end in one row, each still one privacy unit.

A packing collator (`DataCollatorWithFlattening`, TRL's `padding_free=True`) concatenates the chunk's examples into
one row whose `position_ids` restart at 0 at every example. Nothing is computed for padding, and nothing about privacy
changes: the sampler still draws examples, and the engine still clips each example's own gradient, because an
example's gradient on a layer is a sum over its own tokens (`engine.recording(packed=lengths)` regathers each layer's
tokens one example per row before any norm). Attention must not cross examples: transformers builds the block-diagonal
mask from the restarting `position_ids` for causal LMs (no attention mask, no cache) and flash-attention kernels read
`cu_seq_lens`; the trainer's independence probe checks the result on packed chunks as on padded ones.

Here: recognising a packed chunk (`packed_lengths`: each example's tokens, checked against the number of examples the
collator was given), its examples' lengths carried beside the batch (`PACKED_LENGTHS_KEY`), the rows a packed chunk
runs as (`packed_pieces`: whole units, at most `packed_row_tokens` tokens, since SDPA and eager attention compute a row
densely), slicing a packed chunk by examples (`slice_packed`, which recomputes the boundaries flash kernels read), and
`PackedClassificationCollator` for sentence classifiers (one label per sentence).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

#: the collated batch's entry listing, in order, how many tokens each packed example has (never reaches the model)
PACKED_LENGTHS_KEY = "packed_example_lengths"
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
            "whole). Use DataCollatorWithFlattening or TRL's padding_free=True without packing=True.")
    if "attention_mask" in batch:
        raise ValueError(
            "The packed batch carries an attention_mask: transformers then does not build the block-diagonal mask "
            "from the restarting position_ids, and packed examples would attend to each other. Drop the "
            "attention_mask from packed batches (DataCollatorWithFlattening and TRL's padding_free do).")
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
            "padding_free=True.")
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
        batch = {"input_ids": torch.cat(ids)[None],
                 "position_ids": torch.cat([torch.arange(row.numel()) for row in ids])[None]}
        key = "labels" if "labels" in features[0] else "label" if "label" in features[0] else None
        if key is not None:
            labels = [feature[key] for feature in features]
            batch["labels"] = torch.tensor(labels, dtype=torch.float if isinstance(labels[0], float) else torch.long)
        return batch


#: a packed chunk runs as rows of at most this many tokens by default: attention is computed densely over a row (SDPA,
#: eager; flash-attention's varlen kernels excepted), so one row of a whole chunk would cost O(tokens²)
PACKED_ROW_TOKENS = 128


def check_row_tokens(value: Any) -> int | None:
    """`packed_row_tokens` as given: an int >= 1, or None (a packed chunk in one row, for varlen attention)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"packed_row_tokens must be an integer >= 1 or None, got {value!r}.")
    return value


def packed_pieces(unit_sizes: Sequence[int], lengths: torch.Tensor, units_per_piece: int,
                  row_tokens: int | None) -> Iterator[tuple[int, int, list[int]]]:
    """(first example, end example, examples of each unit) of each piece of a packed chunk run as one row: whole units,
    at most `units_per_piece` of them and `row_tokens` tokens (a unit longer than that alone), in order."""
    tokens = [int(n) for n in lengths.tolist()]
    start = example = piece_tokens = 0
    piece: list[int] = []
    for size in (int(n) for n in unit_sizes):
        unit_tokens = sum(tokens[example:example + size])
        full = len(piece) == units_per_piece or (row_tokens is not None and piece_tokens + unit_tokens > row_tokens)
        if piece and full:
            yield start, example, piece
            start, piece, piece_tokens = example, [], 0
        piece.append(size)
        piece_tokens += unit_tokens
        example += size
    if piece:
        yield start, example, piece


def packs(collate: Any, dataset: Any) -> bool:
    """Whether `collate` (the trainer's empty-safe collator) packs: two examples of `dataset` collated as a trial."""
    return PACKED_LENGTHS_KEY in collate([dataset[0], dataset[1]])


def packed_examples(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The packed examples' token counts of a collated batch (None if it is not packed)."""
    lengths = batch.get(PACKED_LENGTHS_KEY)
    return lengths if torch.is_tensor(lengths) else None


def slice_packed(batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Examples start:stop of a packed batch, as a packed batch of their own (their tokens, per-example entries such as
    a sentence's label, and boundaries)."""
    lengths = batch[PACKED_LENGTHS_KEY].cpu()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    first, last = int(offsets[start]), int(offsets[stop])
    part = lengths[start:stop]
    tokens = int(offsets[-1])
    sliced: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _BOUNDARIES:
            continue
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == tokens:
            sliced[key] = value[:, first:last]
        elif torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == lengths.numel():
            sliced[key] = value[start:stop]  # one entry per example (a sentence's label)
        else:
            sliced[key] = value
    sliced[PACKED_LENGTHS_KEY] = part
    sliced.update(_boundaries(batch, part))
    return sliced


def _boundaries(batch: Mapping[str, Any], lengths: torch.Tensor) -> dict[str, Any]:
    """The boundary entries `batch` had, recomputed for `lengths` (as TRL's padding-free collator computes them)."""
    present = [key for key in _BOUNDARIES if key in batch]
    if not present:
        return {}
    device = next(batch[key].device for key in present if torch.is_tensor(batch[key]))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    values = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
              "seq_idx": torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32, device=device),
                                                 lengths.to(device))[None]}
    return {key: values[key] for key in present}
