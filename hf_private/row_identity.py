"""What makes an evaluation row a training example, whatever padding, truncation or tokenisation it was stored with.

The held-out check (`held_out`) compares rows by the keys made here, never by their stored form: the training split
re-tokenised with padding="max_length", with another max_length, or again from its raw text is still training data.

- Tokens: the unpadded `input_ids` of each token row (one, or one per choice for multiple choice). Positions whose
  attention_mask is 0 are dropped, then leading and trailing pad tokens when the tokenizer's pad id is known.
  Per-token companions (attention_mask, token_type_ids, ...) and labels are left out: the same tokens under another
  label or segment ids are still the training example. Other model inputs (e.g. pixel_values) are kept as stored.
- Truncation: see `prefix_key`.
- Text: the string columns both sets have, together, Unicode-NFKC-normalised, case-folded and whitespace-collapsed.
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
# They change with padding and say nothing the tokens do not.
PER_TOKEN = (MASK, "token_type_ids", "position_ids", "special_tokens_mask")
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
    """One row as the check sees it."""

    sequences: tuple[tuple[int, ...], ...]  # unpadded token rows; () without tokens
    others: Any
    text: tuple[str, ...]  # normalised; () without shared text columns

    @property
    def length(self) -> int:
        """Its longest token row: a row as long as its set's limit may have been truncated."""
        return max(map(len, self.sequences), default=0)


def identity(train, eval_dataset, input_columns: Sequence[str], label_columns: set[str],
             pad_token_id: int | None) -> Identity | None:
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
    """Each row of `dataset` as an `Example`, in one pass (streaming sets too)."""
    columns = _columns(dataset) or []
    mask = how.tokens and MASK in columns
    wanted = None if how.others is None else [
        *((TOKENS,) if how.tokens else ()), *((MASK,) if mask else ()), *how.others, *how.texts]
    for row in _rows(dataset, wanted):
        sequences = unpadded(row[TOKENS], row[MASK] if mask else None, how.pad_token_id) if how.tokens else ()
        others = row if how.others is None else tuple(row[c] for c in how.others)
        yield Example(sequences, others, tuple(normalised(row[c]) for c in how.texts))


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
    cut_rows = tuple(row[:cut - 1] if len(row) >= cut else row for row in example.sequences)
    return _digest((cut_rows, example.others))


def text_key(example: Example) -> bytes | None:
    """Its normalised text fields together; None without any."""
    return _digest(example.text) if example.text else None


def unpadded(tokens: Sequence[Any], mask: Sequence[Any] | None,
             pad_token_id: int | None) -> tuple[tuple[int, ...], ...]:
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
        return {name for name, feature in features.items() if getattr(feature, "dtype", None) in ("string",
                                                                                                   "large_string")}
    first = _first(dataset)
    return {name for name, value in first.items() if isinstance(value, str)} if isinstance(first, Mapping) else set()


def _first(dataset) -> Any:
    return next(iter(_iterate(dataset)), None)
