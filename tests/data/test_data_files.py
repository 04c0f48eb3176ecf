"""Local data files: one reader for the recipe and the audit CLI; GLUE-style tsv with bare quotes reads row for row."""

from __future__ import annotations

import argparse

import pytest

from hf_private.cli.audit import _task_from_files
from hf_private.data.files import DataFileError, read_data_file
from tests.support import tiny

# GLUE's tsv layout: sentences contain bare double quotes; a quoting csv reader takes the one opening the first
# sentence as a quoted field and joins rows (here: 2 rows, the first two merged, instead of 3).
TSV = 'sentence\tlabel\n" a quoted start\t1\na " dull plot\t0\nbad acting\t0\n'


def test_tsv_with_bare_quotes_reads_row_for_row(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(TSV)
    data = read_data_file(str(path))
    assert data["sentence"] == ['" a quoted start', 'a " dull plot', "bad acting"] and data["label"] == [1, 0, 0]


def test_missing_file_and_unknown_format_are_named(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        read_data_file(str(tmp_path / "nope.csv"))
    (tmp_path / "train.txt").write_text("x")
    with pytest.raises(DataFileError, match="supported formats are .tsv, .csv"):
        read_data_file(str(tmp_path / "train.txt"))


def test_audit_cli_reads_files_through_the_same_reader(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(TSV)
    tiny.tokenizer().save_pretrained(tmp_path / "model")
    options = argparse.Namespace(
        model_name_or_path=str(tmp_path / "model"),
        train_file=str(path),
        text_column="sentence",
        label_column="label",
        max_seq_length=16,
    )
    _, data, _ = _task_from_files(options)
    assert len(data) == 3 and data["label"] == [1, 0, 0]
    with pytest.raises(SystemExit, match="--train_file: .*does not exist"):
        _task_from_files(argparse.Namespace(**{**vars(options), "train_file": str(tmp_path / "train.txt")}))
