"""Count the label values a private run must know about before training: non-finite floats and ignored integers.

The engine gives an example whose gradient is not finite a zero contribution, so a NaN regression label cannot
poison a release; but that record would then be silently never learnt from: `preflight.check_labels` refuses such
labels, by column and count. Integer labels of -100 get no loss at all (the models' and losses' ignore index): their
count is logged with the plan, so a dataset that masks more than intended shows it before the budget is spent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .logs import get_logger
from .losses import IGNORE_INDEX

logger = get_logger(__name__)

LABEL_COLUMNS = ("labels", "label")


@dataclass(frozen=True)
class LabelCounts:
    """What one pass over the label columns found: non-finite float labels per column, and the -100 labels of the
    first integer label column as (ignored, all, "tokens" or "examples"), None when there is none (a causal LM's
    collator makes its labels; float labels are regression targets)."""

    non_finite: dict[str, int]
    ignored: tuple[int, int, str] | None


def count_labels(dataset) -> LabelCounts:
    """One pass over the label columns of `dataset` (Arrow columns of a datasets.Dataset, else its items)."""
    return _arrow_counts(dataset) if hasattr(dataset, "column_names") else _item_counts(dataset)


def log_ignored_labels(counts: LabelCounts) -> None:
    """One INFO line after the plan: how many label values are -100, in tokens or examples (none if no label column)."""
    if counts.ignored is not None:
        ignored, total, unit = counts.ignored
        logger.info("labels: %s of %s %s are %d (ignored: no loss, no gradient).", f"{ignored:,}", f"{total:,}",
                    unit, IGNORE_INDEX)


def ignored_labels(dataset) -> tuple[int, int, str] | None:
    """(labels equal to -100, all labels, "tokens" or "examples") of the first label column with integer labels."""
    return count_labels(dataset).ignored


def _is_list(arrow_type) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


def _arrow_counts(dataset) -> LabelCounts:
    """datasets.Dataset: count in Arrow, over the selected rows only, without building Python objects."""
    table = dataset.with_format("arrow")
    non_finite, ignored = {}, None
    for column in (c for c in LABEL_COLUMNS if c in dataset.column_names):
        values, unit = table[column], "examples"
        while _is_list(values.type):
            values, unit = pc.list_flatten(values), "tokens"
        if pa.types.is_floating(values.type):
            finite = pc.sum(pc.is_finite(values)).as_py() or 0
            non_finite[column] = len(values) - values.null_count - finite
        elif pa.types.is_integer(values.type) and ignored is None:
            count = pc.sum(pc.equal(values, IGNORE_INDEX)).as_py() or 0
            ignored = (count, len(values) - values.null_count, unit)
    return LabelCounts(non_finite, ignored)


def _item_counts(dataset) -> LabelCounts:
    """A map-style dataset of dicts (a torch Dataset, a list): one pass over its items' labels."""
    non_finite = dict.fromkeys(LABEL_COLUMNS, 0)
    ignored = total = 0
    unit: str | None = None
    integer = True  # the first label column of every item holds integer labels so far
    for index in range(len(dataset)):
        item = dataset[index]
        if not isinstance(item, Mapping):
            continue
        for column in LABEL_COLUMNS:
            if column in item:
                non_finite[column] += _non_finite(item[column])
        column = next((c for c in LABEL_COLUMNS if c in item), None)
        if column is None or not integer:
            continue
        values = torch.as_tensor(item[column])
        if values.is_floating_point() or values.dtype == torch.bool:
            integer = False
            continue
        ignored += int((values == IGNORE_INDEX).sum())
        total += values.numel()
        unit = "tokens" if values.dim() else "examples"
    return LabelCounts(non_finite, (ignored, total, unit) if integer and unit is not None else None)


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
