"""Local data files read by their extension, the same way for the GLUE recipe and the audit CLI."""

from __future__ import annotations

import csv
import os

from datasets import Dataset, load_dataset

FORMATS = {".tsv": "csv", ".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataFileError(ValueError):
    """A data file that does not exist or has a format we do not read; the message says which."""


def read_data_file(path: str) -> Dataset:
    """One tsv/csv/json(l)/parquet file as a Dataset.

    tsv is read without quote handling: GLUE's own tsv files have bare quotes inside sentences, which a
    quoting reader would join across rows.
    """
    if not os.path.isfile(path):
        raise DataFileError(f"Data file {path} does not exist.")
    extension = os.path.splitext(path)[1].lower()
    if extension not in FORMATS:
        raise DataFileError(f"Cannot read {path}: supported formats are {', '.join(FORMATS)}.")
    options = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if extension == ".tsv" else {}
    return load_dataset(FORMATS[extension], data_files={"train": path}, split="train", **options)
