"""A logical batch cut into physical chunks of whole privacy units, padded or packed: the one chunk layout.

Trainer's accumulation loop hands over one Poisson chunk at a time; it can hold more units than fit in a forward. It
is cut into physical chunks of at most `units_per_chunk` units, never inside a unit: a user's examples (user-level
DP) sum into one term that the engine clips, so they must be computed in one chunk. A padded batch is sliced by
examples; a packed batch (examples end to end in one row, `data.packing`) is sliced by its examples' tokens and laid
out as rows of whole units (`packing.packed_pieces`, `packing.lay_out_rows`). Every chunk says how many examples each
of its units has and how many rows each unit makes, which is what the engine records it by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..models.support import is_causal_lm
from .packing import (
    PackedLayout,
    lay_out_rows,
    packed_examples,
    packed_layout,
    packed_pieces,
    packed_shape,
    slice_packed,
)
from .sampling import batch_size_of, slice_examples
from .users import UNIT_SIZES_KEY

__all__ = ["PhysicalChunk", "physical_chunks", "unit_sizes_of", "unit_slices"]


@dataclass(frozen=True)
class PhysicalChunk:
    """One forward/backward's worth of whole units."""

    inputs: dict[str, Any]  # the chunk as the model reads it (padded rows, or packed rows of whole units)
    units: list[int]  # examples of each unit, in order
    rows_per_example: int  # rows the model makes of one example (multiple choice: one a choice; DPO: 2)

    @property
    def unit_rows(self) -> int | list[int]:
        """Rows of each unit, as the engine records them: one count when every unit is one example."""
        rows = self.rows_per_example
        return rows if all(n == 1 for n in self.units) else [n * rows for n in self.units]

    @property
    def layout(self) -> PackedLayout | None:
        """Where a packed chunk's examples lie (None for a padded chunk)."""
        return packed_layout(self.inputs)


def physical_chunks(
    batch: Mapping[str, Any],
    model: nn.Module,
    units_per_chunk: int,
    rows_per_example: Callable[[Mapping[str, Any]], int],
    packed_row_tokens: int | str | None = None,
    packed_forward_tokens: int | None = None,
) -> Iterator[PhysicalChunk]:
    """`batch` (a collated Poisson chunk) in physical chunks of at most `units_per_chunk` whole units, in order.

    A packed batch is laid out as rows of whole units of at most `packed_row_tokens` tokens and at most
    `packed_forward_tokens` padded tokens a forward (`packing.packed_shape`: "auto" rows and varlen kernels are the
    model's). `rows_per_example` reads the rows the model makes of one example from the batch (the trainer family's).
    """
    batch, unit_sizes = unit_sizes_of(batch)
    size = batch_size_of(batch)
    rows = rows_per_example(batch)
    lengths = packed_examples(batch)
    if lengths is None:
        for start, stop, units in unit_slices(unit_sizes, units_per_chunk):
            yield PhysicalChunk({k: slice_examples(v, size, start, stop) for k, v in batch.items()}, units, rows)
        return
    shape = packed_shape(model, packed_row_tokens, packed_forward_tokens)
    mask_padding = not is_causal_lm(model)  # a mean-pooled head reads an attention_mask beside packed positions
    for start, stop, units, row_examples in packed_pieces(unit_sizes, lengths, units_per_chunk, *shape):
        yield PhysicalChunk(lay_out_rows(slice_packed(batch, start, stop), row_examples, mask_padding), units, rows)


def unit_sizes_of(batch: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The collated batch without its unit sizes (`users.UNIT_SIZES_KEY`), and how many consecutive examples each of
    its units has: one each when the batch carries none (every example its own unit)."""
    batch = dict(batch)
    sizes = batch.pop(UNIT_SIZES_KEY, None)
    return batch, [1] * batch_size_of(batch) if sizes is None else [int(n) for n in sizes]


def unit_slices(unit_sizes: Sequence[int], units_per_chunk: int) -> Iterator[tuple[int, int, list[int]]]:
    """(first example, end example, examples of each unit) of each physical chunk of at most `units_per_chunk`
    units, in order."""
    sizes = [int(n) for n in unit_sizes]
    start = 0
    for first in range(0, len(sizes), units_per_chunk):
        part = sizes[first : first + units_per_chunk]
        yield start, start + sum(part), part
        start += sum(part)
