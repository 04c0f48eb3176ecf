"""Refuse non-finite float labels before training, while refusing spends no privacy.

The engine gives an example whose gradient is not finite a zero contribution, so a NaN
regression label cannot poison a release; but that record would then be silently never learnt from. A data bug
is better reported up front, by column and count (no row is named: the message may end up in shared logs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

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


def _arrow_counts(dataset) -> dict[str, int]:
    """datasets.Dataset: count in Arrow, over the selected rows only, without building Python objects."""
    table = dataset.with_format("arrow")
    counts = {}
    for column in (c for c in LABEL_COLUMNS if c in dataset.column_names):
        values = table[column]
        while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or \
                pa.types.is_fixed_size_list(values.type):
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
