"""Evaluation on the training data is never published as held-out.

The card publishes an evaluation set's metrics as held-out only when no row repeats a training example: the training
set itself, a copy under another fingerprint, a re-padded copy and a set with a few training rows are all refused
(other ways of storing a training example: tests/evaluation/test_row_identity.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, concatenate_datasets
from huggingface_hub import ModelCard
from transformers import DataCollatorWithPadding

from hf_private import DPConfig, PrivateTrainer
from hf_private.demos import sentiment as demo
from hf_private.evaluation import row_identity
from hf_private.evaluation.held_out import COMPARED, HELD_OUT, OVERLAPS, UNKNOWN, TrainingRows, card_evaluation
from hf_private.release import model_card
from tests.support import tiny
from tests.support.helpers import training_args

OVERLAP_WARNING = "shares"
HELD_OUT_HEADING = "On held-out data"
CHECKOUT_TEMPLATES = Path(__file__).resolve().parents[2] / "model_cards"
NOT_HELD_OUT = "overlapping the training data"


def _trainer(output_dir, train, eval_dataset=None) -> PrivateTrainer:
    tok = tiny.tokenizer()
    return PrivateTrainer(
        model=tiny.bert(),
        args=training_args(output_dir, max_steps=1),
        train_dataset=train,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0),
    )


def _card(trainer) -> ModelCard:
    trainer.save_model()
    return ModelCard.load(os.path.join(trainer.args.output_dir, "README.md"))


@pytest.fixture
def checkout_template(monkeypatch):
    """Cards from this checkout's template: an editable install may read another checkout's."""
    monkeypatch.setattr(model_card, "resources", SimpleNamespace(files=lambda package: CHECKOUT_TEMPLATES))


def _with_training_rows(train, rows: int):
    """Ten training rows among fresh ones: another fingerprint, shared rows."""
    return concatenate_datasets([train.select(range(rows)), tiny.sentiment_dataset(22, seed=9)])


def _assert_withheld(card: ModelCard, prefix: str, metrics: dict[str, float]) -> None:
    assert HELD_OUT_HEADING not in card.text
    assert f"`{prefix}` was evaluated on data {NOT_HELD_OUT}" in card.text and "un-noised" in card.text
    assert not any(key in card.text for key in metrics if key.startswith(prefix)), "the values must not be published"


def _padded_copy(n: int):
    """The training split tokenised again with padding="max_length": other rows as stored, the same examples."""
    texts, labels = demo.sentiment_texts(n)
    enc = tiny.tokenizer()(texts, truncation=True, padding="max_length", max_length=tiny.SEQ_LEN)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "label": labels})


@pytest.mark.parametrize("evaluated", ["training set", "training rows under another fingerprint", "padded copy"])
def test_evaluation_on_training_data_is_not_published_as_held_out(tmp_path, caplog, evaluated):
    train = tiny.sentiment_dataset(96)
    eval_dataset = {
        "training set": train,
        "training rows under another fingerprint": _with_training_rows(train, 10),
        "padded copy": _padded_copy(96),
    }[evaluated]
    assert evaluated == "training set" or eval_dataset._fingerprint != train._fingerprint
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer = _trainer(tmp_path, train, eval_dataset)
    shared = 10 if evaluated == "training rows under another fingerprint" else len(train)
    assert f"{OVERLAP_WARNING} {shared} of its {len(eval_dataset)} units" in caplog.text
    assert "input_ids" not in caplog.text  # a count, never row contents
    metrics = trainer.evaluate()
    _assert_withheld(_card(trainer), "eval", metrics)


def test_training_set_passed_to_evaluate_later_is_caught(tmp_path, caplog):
    train, dev = tiny.sentiment_dataset(96), tiny.sentiment_dataset(32, seed=9)
    trainer = _trainer(tmp_path, train, dev)
    trainer.evaluate()
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        metrics = trainer.evaluate(train)  # the last metrics under "eval" are now training-set metrics
    assert OVERLAP_WARNING in caplog.text
    _assert_withheld(_card(trainer), "eval", metrics)


def test_disjoint_evaluation_is_published_as_held_out(tmp_path, caplog, checkout_template):
    train, dev = tiny.sentiment_dataset(96), tiny.sentiment_dataset(32, seed=9)
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer = _trainer(tmp_path, train, dev)
        loss = trainer.evaluate()["eval_loss"]
    assert OVERLAP_WARNING not in caplog.text
    card = _card(trainer)
    assert f"{HELD_OUT_HEADING} (checked to repeat no {COMPARED}):" in card.text, "it says what was compared"
    assert NOT_HELD_OUT not in card.text
    assert f"| eval_loss | {round(loss, 4)} |" in card.text
    assert "eval_runtime" not in card.text


def test_dict_of_eval_sets_is_judged_set_by_set(tmp_path):
    train, dev = tiny.sentiment_dataset(96), tiny.sentiment_dataset(32, seed=9)
    trainer = _trainer(tmp_path, train, {"dev": dev, "seen": _with_training_rows(train, 3)})
    metrics = trainer.evaluate()
    card = _card(trainer)
    assert f"| eval_dev_loss | {round(metrics['eval_dev_loss'], 4)} |" in card.text
    assert "`eval_seen` was evaluated on data overlapping the training data" in card.text
    assert "eval_seen_loss" not in card.text


def test_row_hashes_ignore_labels_and_storage_format():
    train = tiny.sentiment_dataset(40)
    rows = TrainingRows(train, ["input_ids", "attention_mask", "label"])  # what the model accepts, as Trainer says
    relabelled = train.select(range(5)).map(lambda row: {"label": 1 - row["label"]})
    assert rows.overlap(relabelled, "relabelled").shared == 5, "the same input under another label is a training input"

    class Tensors(torch.utils.data.Dataset):  # a plain torch dataset holding tensors, not a datasets.Dataset
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {key: torch.tensor(train[i + 10][key]) for key in ("input_ids", "attention_mask", "label")}

    assert rows.overlap(Tensors(), "tensors").shared == 4

    class Stream(torch.utils.data.IterableDataset):  # no length: read by iteration, as evaluation reads it
        def __iter__(self):
            return (train[i] for i in range(20, 23))

    assert rows.overlap(Stream(), "stream").shared == 3
    assert rows.overlap(tiny.sentiment_dataset(40, seed=9), "fresh").shared == 0


# ---------------------------------------------------------------------- units: the sequences of packed rows
LM_INPUTS = ["input_ids", "attention_mask", "position_ids", "seq_lengths", "labels"]


def _packed(dataset: Dataset) -> Dataset:
    """TRL's BFD packing (rows of at most 64 tokens, `seq_lengths` marking each sequence): several sequences a row."""
    from trl import pack_dataset

    packed = pack_dataset(dataset.select_columns(["input_ids"]), 64, "bfd")
    assert len(packed) < len(dataset) and max(map(len, packed["seq_lengths"])) > 1
    return packed


def _packed_by_positions(dataset: Dataset) -> Dataset:
    """Four sequences a row, end to end, marked only by position_ids restarting at 0 (then right padding, masked)."""
    rows = []
    for start in range(0, len(dataset), 4):
        ids = [
            token for row in dataset.select(range(start, min(start + 4, len(dataset))))["input_ids"] for token in row
        ]
        positions = [
            p
            for row in dataset.select(range(start, min(start + 4, len(dataset))))["input_ids"]
            for p in range(len(row))
        ]
        rows.append(
            {"input_ids": ids + [0, 0], "position_ids": positions + [0, 1], "attention_mask": [1] * len(ids) + [0, 0]}
        )
    return Dataset.from_list(rows)


@pytest.mark.parametrize("pack", [_packed, _packed_by_positions], ids=["seq_lengths", "position_ids"])
def test_packed_rows_are_compared_sequence_by_sequence(pack):
    train = tiny.lm_dataset(40)
    rows = TrainingRows(train, LM_INPUTS, pad_token_id=0)
    seen = rows.overlap(pack(train), "packed training set")
    assert (seen.shared, seen.units, seen.verdict) == (40, 40, OVERLAPS)
    assert (
        rows.overlap(
            pack(concatenate_datasets([train.select(range(3)), tiny.lm_dataset(37, seed=9)])),
            "three training sequences",
        ).shared
        == 3
    )
    fresh = rows.overlap(pack(tiny.lm_dataset(40, seed=9)), "fresh")
    assert (fresh.shared, fresh.verdict) == (0, HELD_OUT)


def test_a_packed_training_set_is_compared_by_its_sequences_too():
    train = tiny.lm_dataset(40)
    rows = TrainingRows(_packed(train), LM_INPUTS, pad_token_id=0)
    assert rows.overlap(train.select(range(5)), "five sequences").shared == 5
    assert rows.overlap(tiny.lm_dataset(40, seed=9), "fresh").verdict == HELD_OUT


def test_mutation_packed_rows_compared_whole_pass_as_held_out(monkeypatch):
    """The check as it was: each packed row one unit. The training sequences, packed, then repeat no training row."""
    train = tiny.lm_dataset(40)
    monkeypatch.setattr(row_identity, "_packed_runs", lambda tokens, *args: [list(range(len(tokens)))])
    assert TrainingRows(train, LM_INPUTS, pad_token_id=0).overlap(_packed(train), "packed").verdict == HELD_OUT


def test_rows_that_cannot_be_cut_into_their_sequences_are_unknown(caplog):
    train = tiny.lm_dataset(40)
    rows = TrainingRows(train, LM_INPUTS, pad_token_id=0)
    fresh = _packed(tiny.lm_dataset(40, seed=9))
    miscounted = fresh.map(lambda row: {"seq_lengths": [*row["seq_lengths"][:-1], row["seq_lengths"][-1] + 1]})
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        found = rows.overlap(miscounted, "miscounted")
    assert (found.shared, found.verdict) == (0, UNKNOWN) and "could not be cut apart" in found.unknown
    assert "could not be checked" in caplog.text
    # a packed row whose text belongs to the whole row cannot be cut with its tokens
    texted = fresh.map(lambda row, i: {"text": f"row {i}"}, with_indices=True)
    assert (
        TrainingRows(train.map(lambda row, i: {"text": f"text {i}"}, with_indices=True), LM_INPUTS, pad_token_id=0)
        .overlap(texted, "texted")
        .verdict
        == UNKNOWN
    )
    # on the training side: nothing shows which sequences the evaluation set must not repeat
    packed_train = TrainingRows(_packed(train).map(lambda row: {"seq_lengths": [1]}), LM_INPUTS, pad_token_id=0)
    assert packed_train.overlap(tiny.lm_dataset(40, seed=9), "fresh").verdict == UNKNOWN
    # nothing in common to compare
    assert rows.overlap(Dataset.from_dict({"pixels": [[0.5]] * 4}), "other columns").verdict == UNKNOWN


def test_only_held_out_sets_are_published_and_an_unknown_one_is_named():
    metrics = {"eval_dev_loss": 1.0, "eval_seen_loss": 2.0, "eval_packed_loss": 3.0}
    published, notes = card_evaluation(
        {
            "eval_dev": (HELD_OUT, {"eval_dev_loss": 1.0}),
            "eval_seen": (OVERLAPS, {"eval_seen_loss": 2.0}),
            "eval_packed": (UNKNOWN, {"eval_packed_loss": 3.0}),
        }
    )
    assert published == {"eval_dev_loss": metrics["eval_dev_loss"]}
    assert [note.split(" was evaluated on data ")[0] for note in notes] == ["`eval_seen`", "`eval_packed`"]
    assert "could not be checked against the training data" in notes[1]
