"""Labels of -100 get no loss: their count is logged after the plan, in tokens or examples."""

from __future__ import annotations

import logging

import torch
from datasets import Dataset

from hf_private.label_checks import ignored_labels
from tests import tiny
from tests.helpers import make_trainer


def test_token_labels_are_counted_in_tokens_over_the_selected_rows():
    data = Dataset.from_dict({"labels": [[-100, 5, 6], [-100, -100, 7], [8, 9, 10]]})
    assert ignored_labels(data) == (3, 9, "tokens")
    assert ignored_labels(data.select([1, 2])) == (2, 6, "tokens")


def test_map_style_items_are_counted_and_float_labels_are_not_ignore_indices():
    items = [{"labels": torch.tensor([-100, 1, 2])}, {"labels": torch.tensor([-100, -100, 3])}]
    assert ignored_labels(items) == (3, 6, "tokens")
    assert ignored_labels([{"label": 1}, {"label": -100}]) == (1, 2, "examples")
    assert ignored_labels(Dataset.from_dict({"label": [-100.0, 0.5]})) is None
    assert ignored_labels(tiny.lm_dataset(4)) is None  # the collator makes a causal LM's labels


def test_the_count_is_logged_after_the_plan(tmp_path, caplog):
    data = tiny.sentiment_dataset(96).map(lambda row, i: {"label": -100 if i < 5 else row["label"]}, with_indices=True)
    with caplog.at_level(logging.INFO, logger="transformers.hf_private"):
        make_trainer(tmp_path, dataset=data)
    messages = [r.getMessage() for r in caplog.records]
    plan = next(i for i, m in enumerate(messages) if "training plan" in m.lower())
    assert "labels: 5 of 96 examples are -100 (ignored: no loss, no gradient)." in messages[plan + 1:]
