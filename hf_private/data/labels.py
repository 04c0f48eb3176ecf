"""The labels a private run must get right before training: where they are, their type, non-finite and ignored values.

The engine gives an example whose gradient is not finite a zero contribution, so a NaN regression label cannot
poison a release; but that record would then be silently never learnt from: `preflight.check_labels` refuses such
labels, by column and count. Integer labels of -100 get no loss at all (the models' and losses' ignore index): their
count is logged with the plan, so a dataset that masks more than intended shows it before the budget is spent.

Two data mistakes would otherwise surface only in `train()`, in words that point elsewhere: labels under another
column name (Trainer drops the column the model's forward does not read, and the first batch has no labels) and
string labels (the collator's tensor conversion fails with advice on padding). Both are refused when the trainer is
built (`refuse_string_labels`, `check_collated_labels`), naming the columns found, the one expected and the fix.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..logs import get_logger
from ..models.support import is_causal_lm

logger = get_logger(__name__)

IGNORE_INDEX = -100  # the label transformers' losses skip

LABEL_COLUMNS = ("labels", "label")
# More distinct string labels than this are not class names (a text column named "label"): no mapping is shown, and no
# value either, since the refusal may end up in shared logs.
MAX_CLASS_NAMES_SHOWN = 32


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
        logger.info(
            "labels: %s of %s %s are %d (ignored: no loss, no gradient).",
            f"{ignored:,}",
            f"{total:,}",
            unit,
            IGNORE_INDEX,
        )


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
        first = next((c for c in LABEL_COLUMNS if c in item), None)
        if first is None or not integer:
            continue
        values = torch.as_tensor(item[first])
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


# ---------------------------------------------------------------------- string labels
def string_labels(dataset) -> tuple[str, list[str], str] | None:
    """(column, its distinct values sorted, "tokens" or "examples") of the first label column that holds strings;
    None when none does. Arrow columns are read whole; a map-style dataset's items only when its first item's labels
    are strings."""
    if hasattr(dataset, "column_names"):
        table = dataset.with_format("arrow")
        for column in (c for c in LABEL_COLUMNS if c in dataset.column_names):
            values, unit = table[column], "examples"
            while _is_list(values.type):
                values, unit = pc.list_flatten(values), "tokens"
            if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
                return column, sorted(v for v in pc.unique(values).to_pylist() if v is not None), unit
        return None
    item = dataset[0] if len(dataset) else None  # a map-style dataset of dicts: its first item tells the label type
    if not isinstance(item, Mapping):
        return None
    first = next((c for c in LABEL_COLUMNS if c in item), None)
    value = item[first] if first is not None else None
    if first is not None and (
        isinstance(value, str) or (isinstance(value, list | tuple) and any(isinstance(v, str) for v in value))
    ):
        return first, sorted(_item_strings(dataset, first)), "examples" if isinstance(value, str) else "tokens"
    return None


def _item_strings(dataset, column: str) -> set[str]:
    """The distinct strings among the `column` labels of a map-style dataset's items."""
    found: set[str] = set()
    for index in range(len(dataset)):
        value = dataset[index].get(column)
        found.update(
            [value]
            if isinstance(value, str)
            else [v for v in value if isinstance(v, str)]
            if isinstance(value, list | tuple)
            else []
        )
    return found


def label2id_for(values: list[str], model: Any) -> tuple[dict[str, int], bool]:
    """The mapping to apply: the model's own `config.label2id` when it names every value (not transformers' default
    LABEL_0, LABEL_1, ...), else the values in sorted order; and whether it is the model's."""
    config_mapping = getattr(getattr(model, "config", None), "label2id", None) or {}
    if values and all(value in config_mapping for value in values):
        return {value: int(config_mapping[value]) for value in values}, True
    return {value: index for index, value in enumerate(values)}, False


def refuse_string_labels(dataset, model: Any) -> None:
    """Labels must be integer class ids (or float regression targets): string labels would reach the collator's
    tensor conversion, which fails with advice on padding and truncation. Refused with the mapping to apply."""
    found = string_labels(dataset)
    if found is None:
        return
    column, values, unit = found
    head = (
        f"train_dataset's label column {column!r} holds strings ({len(values)} distinct values"
        f"{' over its tokens' if unit == 'tokens' else ''}): labels must be integer class ids (float values for "
        "regression)."
    )
    if len(values) > MAX_CLASS_NAMES_SHOWN:
        raise ValueError(
            f"{head} That many values are not class names: is {column!r} the label column? Put the "
            "integer class ids under 'label' (or 'labels')."
        )
    mapping, from_model = label2id_for(values, model)
    convert = f"[label2id[t] for t in row[{column!r}]]" if unit == "tokens" else f"label2id[row[{column!r}]]"
    source = "the model's config.label2id" if from_model else "the distinct values in sorted order"
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    classes = (
        f" The model has num_labels={num_labels}, the column {len(mapping)} classes: load it with "
        f"num_labels={len(mapping)}."
        if not from_model and unit == "examples" and num_labels is not None and num_labels != len(mapping)
        else ""
    )
    keep = (
        ""
        if from_model
        else (
            " Give the model the same mapping (from_pretrained(..., label2id=label2id, "
            "id2label={i: name for name, i in label2id.items()})) so predictions read back."
        )
    )
    raise ValueError(
        f"{head} Map them before training ({source}): label2id = {mapping}; train_dataset = "
        f"train_dataset.map(lambda row: {{{column!r}: {convert}}}).{keep}{classes}"
    )


# ---------------------------------------------------------------------- labels in a collated training batch
def check_collated_labels(trainer: Any, labels_entry: str | None) -> None:
    """Collate the first training example as training will (unused columns removed, the trainer's collator) and
    refuse when the batch lacks `labels_entry`, the entry the trainer family's per-unit loss reads (None: the family
    reads none). A collator that makes labels (a causal LM's from input_ids) passes; labels under a column the
    model's forward does not read are dropped by Trainer, so the refusal names the columns it dropped."""
    dataset = trainer.train_dataset
    if labels_entry is None or dataset is None or len(dataset) == 0:
        return
    arrow = hasattr(dataset, "column_names")
    columns = list(dataset.column_names) if arrow else _item_keys(dataset[0])
    kept = trainer._remove_unused_columns(dataset, description="training") if arrow else dataset
    try:
        with _random_state_kept():  # a collator may draw (masked-LM masks): the run's seeded streams stay untouched
            batch = trainer.data_collator([kept[0]])
    except Exception as error:
        error.add_note("(raised collating the first training example when the trainer was built, as training would)")
        raise
    if labels_entry in batch:
        return
    dropped = [c for c in columns if c not in kept.column_names] if arrow else []
    raise ValueError(_missing_labels_message(trainer.model, labels_entry, columns, sorted(batch), dropped))


def _missing_labels_message(model: Any, entry: str, columns: list[str], keys: list[str], dropped: list[str]) -> str:
    found = (
        f"train_dataset has columns {columns}, and a collated training batch has no {entry!r} entry (keys "
        f"{keys}): private training needs each example's label there, from a column named 'label' or 'labels'."
    )
    if is_causal_lm(model):
        return (
            f"{found} A causal LM learns from its input_ids: use a collator that makes the labels from them, "
            "e.g. data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)."
        )
    fix = (
        f" {type(model).__name__}.forward does not read {dropped}, so Trainer drops them before collating: if one "
        f"holds the labels, rename it, e.g. train_dataset = train_dataset.rename_column({dropped[0]!r}, 'label')."
        if dropped
        else " Add the labels as a column named 'label'."
    )
    return f"{found}{fix} Labels must be integer class ids (float values for regression)."


def _item_keys(item: Any) -> list[str]:
    return list(item) if isinstance(item, Mapping) else []


@contextmanager
def _random_state_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's CPU random states as they were, whatever the body draws."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)
