"""Refuse non-finite float labels before training, while refusing spends no privacy; count the ignored ones.

The engine gives an example whose gradient is not finite a zero contribution, so a NaN
regression label cannot poison a release; but that record would then be silently never learnt from. A data bug
is better reported up front, by column and count (no row is named: the message may end up in shared logs).
Integer labels of -100 get no loss at all (the models' and losses' ignore index): their count is logged with the
plan, so a dataset that masks more than intended shows it before the budget is spent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .logs import get_logger
from .losses import IGNORE_INDEX

logger = get_logger(__name__)

LABEL_COLUMNS = ("labels", "label")


def check_finite_labels(dataset) -> None:
    """Raise ValueError if a label column of `dataset` holds NaN or ±inf float values."""
    counts = _arrow_counts(dataset) if hasattr(dataset, "column_names") else _item_counts(dataset)
    bad = {column: count for column, count in counts.items() if count}
    if bad:
        found = ", ".join(f"{count} in column {column!r}" for column, count in bad.items())
        raise ValueError(
            f"train_dataset has non-finite float labels (NaN or inf): {found}. Such an example gets no gradient "
            "(a non-finite example contributes zero to every private step), so fix or remove these records "
            "before training."
        )


def log_ignored_labels(dataset) -> None:
    """One INFO line after the plan: how many label values are -100, in tokens or examples (none if no label column)."""
    counted = ignored_labels(dataset)
    if counted is not None:
        ignored, total, unit = counted
        logger.info("labels: %s of %s %s are %d (ignored: no loss, no gradient).", f"{ignored:,}", f"{total:,}",
                    unit, IGNORE_INDEX)


def ignored_labels(dataset) -> tuple[int, int, str] | None:
    """(labels equal to -100, all labels, "tokens" or "examples") of the first label column with integer labels.

    None when there is none (a causal LM's collator makes its labels; float labels are regression targets)."""
    return _arrow_ignored(dataset) if hasattr(dataset, "column_names") else _item_ignored(dataset)


def _arrow_ignored(dataset) -> tuple[int, int, str] | None:
    table = dataset.with_format("arrow")
    for column in (c for c in LABEL_COLUMNS if c in dataset.column_names):
        values, unit = table[column], "examples"
        while _is_list(values.type):
            values, unit = pc.list_flatten(values), "tokens"
        if pa.types.is_integer(values.type):
            ignored = pc.sum(pc.equal(values, IGNORE_INDEX)).as_py() or 0
            return ignored, len(values) - values.null_count, unit
    return None


def _item_ignored(dataset) -> tuple[int, int, str] | None:
    """A map-style dataset of dicts: one pass over its items' integer labels."""
    ignored = total = 0
    unit = None
    for index in range(len(dataset)):
        item = dataset[index]
        column = next((c for c in LABEL_COLUMNS if isinstance(item, Mapping) and c in item), None)
        if column is None:
            continue
        values = torch.as_tensor(item[column])
        if values.is_floating_point() or values.dtype == torch.bool:
            return None
        ignored += int((values == IGNORE_INDEX).sum())
        total += values.numel()
        unit = "tokens" if values.dim() else "examples"
    return None if unit is None else (ignored, total, unit)


def _is_list(arrow_type) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


def _arrow_counts(dataset) -> dict[str, int]:
    """datasets.Dataset: count in Arrow, over the selected rows only, without building Python objects."""
    table = dataset.with_format("arrow")
    counts = {}
    for column in (c for c in LABEL_COLUMNS if c in dataset.column_names):
        values = table[column]
        while _is_list(values.type):
            values = pc.list_flatten(values)
        if pa.types.is_floating(values.type):
            finite = pc.sum(pc.is_finite(values)).as_py() or 0
            counts[column] = len(values) - values.null_count - finite
    return counts


def _item_counts(dataset) -> dict[str, int]:
    """A map-style dataset of dicts (a torch Dataset, a list): one pass over its items' labels."""
    counts = dict.fromkeys(LABEL_COLUMNS, 0)
    for index in range(len(dataset)):
        item = dataset[index]
        if isinstance(item, Mapping):
            for column in LABEL_COLUMNS:
                if column in item:
                    counts[column] += _non_finite(item[column])
    return counts


def _non_finite(value) -> int:
    if torch.is_tensor(value):
        return int((~torch.isfinite(value)).sum()) if value.is_floating_point() else 0
    if isinstance(value, np.ndarray | np.floating):
        return int((~np.isfinite(value)).sum()) if np.issubdtype(value.dtype, np.floating) else 0
    if isinstance(value, float):
        return 0 if math.isfinite(value) else 1
    if isinstance(value, list | tuple):
        return sum(_non_finite(v) for v in value)
    return 0
