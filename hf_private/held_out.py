"""Is an evaluation set held out? Checked against the training set before its metrics are called held-out.

Metrics on training examples are un-noised functions of the private data: the card must
never present them as a held-out result. An evaluation set overlaps the training set when it is the same object,
has the same `datasets` fingerprint, or shares a row: a 128-bit blake2b hash of each row's model-input columns.
Label columns are left out of the hash, since the same input under another label still shows what the model
learnt from that training example.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .logs import get_logger

logger = get_logger(__name__)

HELD_OUT = "held-out"
OVERLAPS = "overlaps the training data"

_LABEL_COLUMNS = ("label", "labels", "label_ids")
_TIMING_METRICS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
_BATCH = 4096


class TrainingRows:
    """The training set's row hashes, computed once (on first need) per set of hashed columns."""

    def __init__(self, train_dataset, input_columns: Sequence[str], label_columns: Sequence[str] = ()) -> None:
        self.train_dataset = train_dataset
        self.input_columns = list(input_columns)  # what the model accepts; other columns never reach it
        self.label_columns = {*_LABEL_COLUMNS, *label_columns}
        self._hashes: dict[tuple[str, ...] | None, set[bytes]] = {}
        self._checked: dict[int, tuple[Any, int]] = {}  # id → (dataset, overlap); holding it keeps its id unique

    def overlap(self, eval_dataset, name: str) -> int:
        """How many rows of `eval_dataset` are training rows (all, for the training set); warns once per set."""
        seen = self._checked.get(id(eval_dataset))
        if seen is not None and seen[0] is eval_dataset:
            return seen[1]
        count, size = self._count_overlap(eval_dataset)
        self._checked[id(eval_dataset)] = (eval_dataset, count)
        if count:
            logger.warning(
                "Evaluation set %r shares %d of its %d rows with the training data: its metrics are un-noised "
                "functions of the private training data, not a held-out result, and the model card will not "
                "publish them.", name, count, size,
            )
        return count

    def _count_overlap(self, eval_dataset) -> tuple[int, int]:
        """(rows of `eval_dataset` that are training rows, rows of `eval_dataset`); one pass, streaming sets too."""
        train = self.train_dataset
        fingerprint = getattr(eval_dataset, "_fingerprint", None)
        if eval_dataset is train or (fingerprint is not None and fingerprint == getattr(train, "_fingerprint", None)):
            return len(eval_dataset), len(eval_dataset)
        columns = self._hashed_columns(eval_dataset)
        if columns == ():
            return 0, 0  # no column in common: no row can be shared
        if columns not in self._hashes:
            self._hashes[columns] = set(row_hashes(train, columns))
        known = self._hashes[columns]
        shared = size = 0
        for digest in row_hashes(eval_dataset, columns):
            shared += digest in known
            size += 1
        return shared, size

    def _hashed_columns(self, eval_dataset) -> tuple[str, ...] | None:
        """Model-input columns both sets have; all shared non-label columns if none; None for rows without columns."""
        train_columns, eval_columns = _columns(self.train_dataset), _columns(eval_dataset)
        if train_columns is None or eval_columns is None:
            return None if train_columns is None and eval_columns is None else ()
        shared = [c for c in train_columns if c in eval_columns and c not in self.label_columns]
        inputs = tuple(c for c in shared if c in self.input_columns)
        return inputs or tuple(shared)


def row_hashes(dataset, columns: tuple[str, ...] | None) -> Iterator[bytes]:
    """blake2b-128 of each row's `columns` (the whole row for None), over a canonical repr of plain Python values."""
    for values in _rows(dataset, columns):
        yield hashlib.blake2b(repr(values).encode(), digest_size=16).digest()


def _rows(dataset, columns: tuple[str, ...] | None) -> Iterable[Any]:
    if hasattr(dataset, "select_columns") and columns is not None:  # datasets.Dataset: Arrow batches, plain values
        for batch in dataset.select_columns(list(columns)).with_format(None).iter(batch_size=_BATCH):
            yield from zip(*(batch[c] for c in columns))
        return
    for row in _iterate(dataset):
        yield _plain(row) if columns is None else tuple(_plain(row[c]) for c in columns)


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
    first = next(iter(_iterate(dataset)), None)
    return list(first) if isinstance(first, Mapping) else None


def eval_sets(eval_dataset, prefix: str = "eval") -> Iterator[tuple[str, Any]]:
    """(metric key prefix, dataset) for each evaluation set, named as `Trainer.evaluate` prefixes its metrics."""
    if isinstance(eval_dataset, Mapping):
        for name, dataset in eval_dataset.items():
            yield f"{prefix}_{name}", dataset
    elif eval_dataset is not None:
        yield prefix, eval_dataset


def published_metrics(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """What `evaluate(metric_key_prefix=prefix)` returned, less timings and memory (not results)."""
    start = f"{prefix}_"
    return {key: round(value, 4) for key, value in metrics.items() if key.startswith(start)
            and key[len(start):] not in _TIMING_METRICS and not key[len(start):].startswith("mem_")}


def card_evaluation(results: Mapping[str, tuple[str, dict[str, float]]]) -> tuple[dict[str, float], list[str]]:
    """(held-out metrics the card publishes, a note for each evaluation set it withholds) from prefix → (status,
    metrics)."""
    published: dict[str, float] = {}
    notes = []
    for prefix, (status, metrics) in results.items():
        if status == HELD_OUT:
            published.update(metrics)
        else:
            notes.append(f"`{prefix}` was evaluated on data overlapping the training data: its metrics are "
                         "un-noised, not covered by the privacy guarantee and not a held-out result, so they are "
                         "not published.")
    return published, notes
