"""`data.chunks.physical_chunks`: a collated Poisson chunk cut into physical chunks of whole units, padded or packed,
each saying how many examples and rows each of its units has."""

from __future__ import annotations

import torch
from transformers import DataCollatorWithFlattening

from hf_private.data.chunks import physical_chunks, unit_sizes_of, unit_slices
from hf_private.data.packing import PACKED_LENGTHS_KEY, PACKED_ROWS_KEY
from hf_private.data.sampling import EmptySafeCollator
from hf_private.data.users import UNIT_SIZES_KEY
from tests.support import tiny

UNITS = [2, 1, 3, 1]  # examples of each unit (user-level: a user's examples, consecutive)
EXAMPLES = sum(UNITS)


def one_row(batch: dict) -> int:
    return 1


def two_rows(batch: dict) -> int:  # a DPO pair: a chosen and a rejected row
    return 2


def padded_batch(unit_sizes: list[int] | None = UNITS) -> dict:
    """Example i's row is filled with i, so a chunk's rows name its examples."""
    batch = {"input_ids": torch.arange(EXAMPLES)[:, None].repeat(1, 5), "labels": torch.arange(EXAMPLES)}
    if unit_sizes is not None:
        batch[UNIT_SIZES_KEY] = torch.tensor(unit_sizes)
    return batch


def test_unit_slices_cut_between_units_never_inside_one():
    assert list(unit_slices([2, 1, 3, 1], 2)) == [(0, 3, [2, 1]), (3, 7, [3, 1])]
    assert list(unit_slices([1, 1, 1], 2)) == [(0, 2, [1, 1]), (2, 3, [1])]


def test_a_padded_chunk_holds_whole_units_in_order():
    chunks = list(physical_chunks(padded_batch(), tiny.gpt2(), 2, one_row))
    assert [chunk.units for chunk in chunks] == [[2, 1], [3, 1]]
    assert [chunk.inputs["labels"].tolist() for chunk in chunks] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [chunk.inputs["input_ids"][:, 0].tolist() for chunk in chunks] == [[0, 1, 2], [3, 4, 5, 6]]
    assert all(UNIT_SIZES_KEY not in chunk.inputs and chunk.layout is None for chunk in chunks)


def test_rows_per_unit_count_every_row_of_every_example_of_the_unit():
    chunks = list(physical_chunks(padded_batch(), tiny.gpt2(), 3, two_rows))
    assert [chunk.unit_rows for chunk in chunks] == [[4, 2, 6], 2]  # the last: one unit of one example, one count
    assert [chunk.rows_per_example for chunk in chunks] == [2, 2]


def test_without_unit_sizes_every_example_is_a_unit_of_one_count():
    chunks = list(physical_chunks(padded_batch(None), tiny.gpt2(), 3, two_rows))
    assert [chunk.units for chunk in chunks] == [[1, 1, 1], [1, 1, 1], [1]]
    assert [chunk.unit_rows for chunk in chunks] == [2, 2, 2]  # one count: every unit one example of two rows


def test_unit_sizes_of_reads_the_batch_entry_or_one_each():
    batch, sizes = unit_sizes_of(padded_batch())
    assert sizes == UNITS and UNIT_SIZES_KEY not in batch
    assert unit_sizes_of(padded_batch(None))[1] == [1] * EXAMPLES


def packed(unit_sizes: list[int]) -> tuple[dict, list[list[int]]]:
    """A packed batch of the tiny LM's examples (one row, position_ids restarting) with its unit sizes, and each
    example's tokens."""
    data = tiny.lm_dataset(sum(unit_sizes))
    features = [{"input_ids": data[i]["input_ids"]} for i in range(len(data))]
    batch = dict(EmptySafeCollator(DataCollatorWithFlattening(), features[0])(features))
    batch[UNIT_SIZES_KEY] = torch.tensor(unit_sizes)
    return batch, [list(feature["input_ids"]) for feature in features]


def test_a_packed_chunk_holds_whole_units_laid_out_in_rows_of_whole_units():
    batch, tokens = packed(UNITS)
    model = tiny.gpt2(attn_implementation="eager")  # masked attention: several rows a forward
    row_tokens = max(len(t) for t in tokens) + 1  # at most about one example a row: units span rows
    chunks = list(physical_chunks(batch, model, 2, one_row, packed_row_tokens=row_tokens))
    assert [chunk.units for chunk in chunks] == [[2, 1], [3, 1]]
    assert [chunk.layout.rows for chunk in chunks] == [2, 2]  # each chunk's units in rows of their own
    first = 0
    for chunk in chunks:
        examples = tokens[first : first + sum(chunk.units)]
        layout = chunk.layout
        assert layout.lengths.tolist() == [len(t) for t in examples]
        # every example's tokens whole, in order, wherever its row put them
        laid = chunk.inputs["input_ids"].flatten()[layout.token_index()]
        assert laid.tolist() == [token for example in examples for token in example]
        # a row never splits a unit: row boundaries fall on unit boundaries
        unit_ends = set(torch.tensor(chunk.units).cumsum(0).tolist())
        rows = chunk.inputs.get(PACKED_ROWS_KEY, torch.tensor([sum(chunk.units)]))
        assert set(rows.cumsum(0).tolist()) <= unit_ends
        assert chunk.unit_rows == chunk.units and chunk.inputs[PACKED_LENGTHS_KEY].numel() == sum(chunk.units)
        first += sum(chunk.units)
    assert first == EXAMPLES


def test_a_packed_chunk_in_one_row_when_rows_are_unbounded():
    batch, tokens = packed([1, 1, 1])
    chunks = list(physical_chunks(batch, tiny.gpt2(attn_implementation="eager"), 3, one_row, packed_row_tokens=None))
    assert len(chunks) == 1 and chunks[0].layout.rows == 1 and chunks[0].unit_rows == 1
    assert chunks[0].inputs["input_ids"].shape == (1, sum(len(t) for t in tokens))
