"""GLUE data for the recipe: from the Hub when reachable, otherwise from local tsv/csv/json/parquet files.

Everything is checked before training starts (missing files, unknown formats, missing columns, unlabelled
splits), because a DP run spends privacy budget: failing after it started wastes it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from datasets import ClassLabel, Dataset, DatasetDict, Value, load_dataset
from pyarrow.lib import ArrowInvalid

from hf_private.data.files import FORMATS, DataFileError, read_data_file

logger = logging.getLogger("recipes.glue")


class DataError(ValueError):
    """Bad recipe input; the message says what to change."""


@dataclass(frozen=True)
class TaskSpec:
    text_columns: tuple[str, ...]
    num_labels: int  # 1 = regression
    label_names: tuple[str, ...] = ()  # for files that spell labels out (original GLUE tsv files)
    validation_split: str = "validation"


TASKS = {
    "sst2": TaskSpec(("sentence",), 2, ("negative", "positive")),
    "cola": TaskSpec(("sentence",), 2, ("unacceptable", "acceptable")),
    "mrpc": TaskSpec(("sentence1", "sentence2"), 2, ("not_equivalent", "equivalent")),
    "qqp": TaskSpec(("question1", "question2"), 2, ("not_duplicate", "duplicate")),
    "stsb": TaskSpec(("sentence1", "sentence2"), 1),
    "mnli": TaskSpec(("premise", "hypothesis"), 3, ("entailment", "neutral", "contradiction"), "validation_matched"),
    "qnli": TaskSpec(("question", "sentence"), 2, ("entailment", "not_entailment")),
    "rte": TaskSpec(("sentence1", "sentence2"), 2, ("entailment", "not_entailment")),
}


def task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise DataError(f"Unknown GLUE task {task!r}; choose one of {', '.join(TASKS)}.")
    return TASKS[task]


def find_data_files(data_dir: str) -> tuple[str, str | None]:
    """train.* and dev.*/validation.* in a directory (the layout of GLUE's own downloads, e.g. data/sst2/)."""
    if not os.path.isdir(data_dir):
        raise DataError(f"--data_dir {data_dir} is not a directory.")

    def first(stems: tuple[str, ...]) -> str | None:
        for stem in stems:
            for ext in FORMATS:
                path = os.path.join(data_dir, stem + ext)
                if os.path.isfile(path):
                    return path
        return None

    train = first(("train",))
    if train is None:
        raise DataError(
            f"--data_dir {data_dir} has no train file (train{{{','.join(FORMATS)}}}); found "
            f"{sorted(os.listdir(data_dir))}."
        )
    return train, first(("validation", "dev", "validation_matched", "dev_matched"))


def load_local(train_file: str, validation_file: str | None) -> DatasetDict:
    splits = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
    return DatasetDict({split: _load_file(path) for split, path in splits.items()})


def _load_file(path: str) -> Dataset:
    try:
        return read_data_file(path)
    except DataFileError as error:
        raise DataError(str(error)) from error


def load_hub(dataset_name: str, task: str) -> DatasetDict:
    """`load_dataset(dataset_name, task)`, failing fast offline with a pointer to local files."""
    from huggingface_hub import constants

    hint = (
        f"pass --train_file/--validation_file (tsv, csv, json or parquet) or --data_dir with the {task} data, "
        "or run without --model_name_or_path for the offline demo."
    )
    if constants.HF_HUB_OFFLINE:
        raise DataError(f"Offline (HF_HUB_OFFLINE is set), so {dataset_name}/{task} cannot be downloaded: {hint}")
    try:
        raw = load_dataset(dataset_name, task)
    except (ConnectionError, OSError) as error:
        raise DataError(f"Could not load {dataset_name}/{task} from the Hub ({error}): {hint}") from error
    validation = task_spec(task).validation_split
    return DatasetDict({"train": raw["train"], **({"validation": raw[validation]} if validation in raw else {})})


def prepare(
    raw: DatasetDict, task: str, text_columns: tuple[str, ...], label_column: str, sources: dict[str, str]
) -> DatasetDict:
    """Check columns, turn spelled-out labels into ids, and keep only the text columns and `label`."""
    spec = task_spec(task)
    prepared = {}
    for split, data in raw.items():
        where = sources.get(split, split)
        missing = [c for c in (*text_columns, label_column) if c not in data.column_names]
        if missing:
            raise DataError(
                f"{where} lacks column(s) {missing} needed for {task} (columns found: {data.column_names}). Rename "
                "them, or point --text_columns/--label_column at the right ones."
            )
        data = data.select_columns([*text_columns, label_column])
        if label_column != "label":
            data = data.rename_column(label_column, "label")
        prepared[split] = _check_labels(data, spec, task, where)
    return DatasetDict(prepared)


def _check_labels(data: Dataset, spec: TaskSpec, task: str, where: str) -> Dataset:
    labels = data["label"]
    if len(labels) == 0:
        raise DataError(f"{where} has no rows.")
    if spec.num_labels == 1:
        try:
            return data.cast_column("label", Value("float32"))
        except (TypeError, ValueError, ArrowInvalid) as error:
            raise DataError(f"{where}: {task} is a regression task; labels must be numbers ({error}).") from error
    if isinstance(labels[0], str):
        names = {name: i for i, name in enumerate(spec.label_names)}
        unknown = sorted({x for x in labels if x not in names})
        if unknown:
            raise DataError(f"{where}: labels {unknown[:5]} are not {task} labels {list(names)}.")
        return data.cast_column("label", ClassLabel(names=list(spec.label_names)))
    bad = sorted({x for x in labels if not (isinstance(x, int) and 0 <= x < spec.num_labels)})
    if bad:
        hint = " (-1 marks GLUE's unlabelled test split: evaluate on the validation split)" if -1 in bad else ""
        raise DataError(f"{where}: labels {bad[:5]} are outside 0..{spec.num_labels - 1} for {task}{hint}.")
    return data
