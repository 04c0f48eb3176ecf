"""What makes an evaluation row a training example, whatever padding, truncation or tokenisation it was stored with.

The held-out check (`held_out`) compares rows by the keys made here, never by their stored form: the training split
re-tokenised with padding="max_length", with another max_length, or again from its raw text is still training data.

- Tokens: the unpadded `input_ids` of each token row (one, or one per choice for multiple choice). Positions whose
  attention_mask is 0 are dropped, then leading and trailing pad tokens when the tokenizer's pad id is known.
  Per-token companions (attention_mask, token_type_ids, ...) and labels are left out: the same tokens under another
  label or segment ids are still the training example. Other model inputs (e.g. pixel_values) are kept as stored.
- Truncation: see `prefix_key`.
- Text: the string columns both sets have, together, Unicode-NFKC-normalised, case-folded and whitespace-collapsed.
- Units: a row that packs several sequences (TRL's `seq_lengths`, or `position_ids` restarting at 0 within the
  attended tokens) is cut into them, and each is compared alone: a packed row repeats no training row, but its
  sequences may each be one. A packed row whose marks do not add up, or whose other columns cannot be cut with its
  tokens, is kept whole and marked `undivided`: nothing then shows that it holds no training sequence.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any, NamedTuple

import numpy as np
import torch

TOKENS = "input_ids"
MASK = "attention_mask"
POSITIONS = "position_ids"
#: TRL's mark of a packed row: the length of each sequence in it, in order
SEQ_LENGTHS = "seq_lengths"
# They change with padding or packing and say nothing the tokens do not.
PER_TOKEN = (MASK, "token_type_ids", POSITIONS, "special_tokens_mask", SEQ_LENGTHS)
# Fewest leading tokens two rows must share for a truncation match: shorter common openings are common phrases.
MIN_PREFIX = 16
_BATCH = 4096


@dataclass(frozen=True)
class Identity:
    """What two sets are compared on: their tokens (when both have `input_ids`), other model inputs as stored
    (None: whole rows, for sets whose rows have no columns) and the text columns both have."""

    tokens: bool
    others: tuple[str, ...] | None
    texts: tuple[str, ...]
    pad_token_id: int | None


class Example(NamedTuple):
    """One unit as the check sees it: a row, or one sequence of a packed row."""

    sequences: tuple[tuple[int, ...], ...]  # unpadded token rows; () without tokens
    others: Any
    text: tuple[str, ...]  # normalised; () without shared text columns
    undivided: bool = False  # a packed row that could not be cut into its sequences, keyed whole

    @property
    def length(self) -> int:
        """Its longest token row: a row as long as its set's limit may have been truncated."""
        return max(map(len, self.sequences), default=0)


def identity(
    train, eval_dataset, input_columns: Sequence[str], label_columns: set[str], pad_token_id: int | None
) -> Identity | None:
    """How rows of the two sets are compared; None when they have no column in common (no row can be shared)."""
    train_columns, eval_columns = _columns(train), _columns(eval_dataset)
    if train_columns is None or eval_columns is None:
        return Identity(False, None, (), None) if train_columns is None and eval_columns is None else None
    shared = [c for c in train_columns if c in eval_columns and c not in label_columns]
    if not shared:
        return None
    strings = _string_columns(train) & _string_columns(eval_dataset)
    texts = tuple(c for c in shared if c in strings)
    if TOKENS in shared:
        others = tuple(c for c in shared if c in input_columns and c != TOKENS and c not in PER_TOKEN + texts)
        return Identity(True, others, texts, pad_token_id)
    inputs = tuple(c for c in shared if c in input_columns)
    return Identity(False, inputs or tuple(shared), texts, pad_token_id)


def examples(dataset, how: Identity) -> Iterator[Example]:
    """Each unit of `dataset` as an `Example` (a row, or each sequence of a packed row), in one pass (streaming sets
    too)."""
    columns = _columns(dataset) or []
    mask = how.tokens and MASK in columns
    marks = [c for c in (SEQ_LENGTHS, POSITIONS) if how.tokens and c in columns][:1]  # seq_lengths, if both
    wanted = (
        None
        if how.others is None
        else [*((TOKENS,) if how.tokens else ()), *((MASK,) if mask else ()), *marks, *how.others, *how.texts]
    )
    for row in _rows(dataset, wanted):
        runs = _packed_runs(row[TOKENS], row[marks[0]], marks[0], row[MASK] if mask else None) if marks else [[]]
        if runs is not None and len(runs) == 1:
            sequences = unpadded(row[TOKENS], row[MASK] if mask else None, how.pad_token_id) if how.tokens else ()
            others = row if how.others is None else tuple(row[c] for c in how.others)
            yield Example(sequences, others, tuple(normalised(row[c]) for c in how.texts))
        else:
            yield from _units(row, runs, how, mask)


def _units(row: Mapping[str, Any], runs: list[list[int]] | None, how: Identity, mask: bool) -> Iterator[Example]:
    """The sequences of a packed row (`runs`: each one's token positions), each keyed as an unpacked row would be.
    The row is kept whole, `undivided`, when its marks do not add up (None), or when it has text columns or model
    inputs that are not one value per token (they belong to the whole row)."""
    assert how.others is not None, "a set compared on whole rows has no tokens, so no packed row"
    tokens = row[TOKENS]
    per_token = all(isinstance(row[c], list) and len(row[c]) == len(tokens) for c in how.others)
    if runs is None or how.texts or not per_token:
        yield Example(
            unpadded(tokens, row[MASK] if mask else None, how.pad_token_id),
            tuple(row[c] for c in how.others),
            tuple(normalised(row[c]) for c in how.texts),
            undivided=True,
        )
        return
    for run in runs:
        sequence = _unpadded_row([tokens[i] for i in run], None, how.pad_token_id)
        if sequence:  # a run of padding alone is no unit
            yield Example((sequence,), tuple([row[c][i] for i in run] for c in how.others), ())


def _packed_runs(tokens: list[Any], marks: Any, mark: str, mask: list[int] | None) -> list[list[int]] | None:
    """The token positions of each sequence of a flat token row, from its `seq_lengths` or from its `position_ids`
    restarting at 0 (positions whose attention_mask is 0 left out): one run for a row that packs nothing, None when
    the marks do not add up to the row."""
    if not tokens or isinstance(tokens[0], list):
        return [list(range(len(tokens)))]  # empty, or one row per choice: nothing packed
    if mark == SEQ_LENGTHS:
        if not isinstance(marks, list) or sum(marks) != len(tokens) or min(marks, default=0) < 1:
            return None
        starts = np.cumsum([0, *marks]).tolist()
        return [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    if not isinstance(marks, list) or len(marks) != len(tokens):
        return None
    attended = [i for i in range(len(tokens)) if mask is None or mask[i]]
    restarts = [k for k in range(1, len(attended)) if marks[attended[k]] == 0]
    if not restarts:
        return [attended]
    runs = [attended[a:b] for a, b in zip([0, *restarts], [*restarts, len(attended)])]
    return runs if all(marks[i] == j for run in runs for j, i in enumerate(run)) else None


def token_key(example: Example) -> bytes:
    """Its unpadded tokens and other model inputs."""
    return _digest((example.sequences, example.others))


def prefix_key(example: Example, cut: int) -> bytes:
    """Its key as if truncated at `cut` tokens, for sets stored at different max_length.

    Right truncation at `cut` keeps a row's first `cut` tokens, the last of which may be a special token (BERT's
    [SEP]): rows at least `cut` long are keyed by their first cut - 1 tokens, shorter token rows whole. `held_out`
    cuts at the shorter of the two sets' longest rows (where a truncated set stops), when the two differ, and compares
    only rows at least that long: shorter rows were not truncated and match whole or not at all. It cuts only when
    cut - 1 >= MIN_PREFIX: different texts often open alike ("the movie was ..."), but sixteen shared leading tokens
    at the very length where one set stops is a copy; a long shared template can make this err towards overlap.
    """
    cut_rows = tuple(row[: cut - 1] if len(row) >= cut else row for row in example.sequences)
    return _digest((cut_rows, example.others))


def text_key(example: Example) -> bytes | None:
    """Its normalised text fields together; None without any."""
    return _digest(example.text) if example.text else None


def unpadded(
    tokens: Sequence[Any], mask: Sequence[Any] | None, pad_token_id: int | None
) -> tuple[tuple[int, ...], ...]:
    """Each token row without padding: masked positions dropped, then pad ids at either end."""
    if tokens and isinstance(tokens[0], list):  # one row per choice
        masks = mask if mask is not None else [None] * len(tokens)
        return tuple(_unpadded_row(row, row_mask, pad_token_id) for row, row_mask in zip(tokens, masks))
    return (_unpadded_row(tokens, mask, pad_token_id),)


def _unpadded_row(tokens: Sequence[int], mask: Sequence[int] | None, pad_token_id: int | None) -> tuple[int, ...]:
    kept = list(tokens) if mask is None else list(compress(tokens, mask))
    if pad_token_id is None:
        return tuple(kept)
    start, end = 0, len(kept)
    while start < end and kept[start] == pad_token_id:
        start += 1
    while end > start and kept[end - 1] == pad_token_id:
        end -= 1
    return tuple(kept[start:end])


def normalised(text: Any) -> str:
    """Case, Unicode form and spacing are not what makes a text another example."""
    return " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())


def _digest(value: Any) -> bytes:
    """blake2b-128 of a canonical repr of plain Python values."""
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()


def _rows(dataset, columns: list[str] | None) -> Iterable[Any]:
    """Plain rows: dicts of `columns` (the whole row for None)."""
    if hasattr(dataset, "select_columns") and columns is not None:  # datasets.Dataset: Arrow batches, plain values
        for batch in dataset.select_columns(columns).with_format(None).iter(batch_size=_BATCH):
            yield from (dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns)))
        return
    for row in _iterate(dataset):
        yield _plain(row) if columns is None else {c: _plain(row[c]) for c in columns}


def _iterate(dataset) -> Iterable[Any]:
    """Rows by index for map-style sets (their __iter__ may not exist), else by iteration (streaming sets)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return (dataset[index] for index in range(len(dataset)))
    return iter(dataset)


def _plain(value: Any) -> Any:
    """Tensors, arrays and numpy scalars as the lists and numbers a `datasets.Dataset` row holds."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return tuple((key, _plain(value[key])) for key in sorted(value))
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _columns(dataset) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    first = _first(dataset)
    return list(first) if isinstance(first, Mapping) else None


def _string_columns(dataset) -> set[str]:
    """Columns holding one string per row (from the schema when there is one, else from the first row)."""
    features = getattr(dataset, "features", None)
    if features is not None:
        return {
            name for name, feature in features.items() if getattr(feature, "dtype", None) in ("string", "large_string")
        }
    first = _first(dataset)
    return {name for name, value in first.items() if isinstance(value, str)} if isinstance(first, Mapping) else set()


def _first(dataset) -> Any:
    return next(iter(_iterate(dataset)), None)
