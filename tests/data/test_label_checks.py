"""Labels of -100 get no loss: their count is logged after the plan, in tokens or examples. Labels under another
column name and string labels are refused when the trainer is built, with the fix."""

from __future__ import annotations

import ast
import contextlib
import logging
import random
import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_private import DPConfig, PrivateTrainer
from hf_private.data import labels as label_checks
from hf_private.data.labels import MAX_CLASS_NAMES_SHOWN, ignored_labels, refuse_string_labels, string_labels
from tests.support import tiny
from tests.support.helpers import make_trainer, training_args


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
    assert "labels: 5 of 96 examples are -100 (ignored: no loss, no gradient)." in messages[plan + 1 :]


# ---------------------------------------------------------------------- mistakes refused at construction, with the fix
def test_labels_under_another_name_are_refused_at_construction_and_the_named_fix_builds(tmp_path):
    data = tiny.sentiment_dataset(96).rename_column("label", "sentiment")
    with pytest.raises(ValueError) as refused:
        make_trainer(tmp_path, dataset=data)
    message = str(refused.value)
    assert "train_dataset has columns ['input_ids', 'attention_mask', 'sentiment']" in message
    assert (
        "BertForSequenceClassification.forward does not read ['sentiment'], so Trainer drops them before "
        "collating: if one holds the labels, rename it, e.g. train_dataset = train_dataset.rename_column("
        "'sentiment', 'label')."
    ) in message
    assert make_trainer(tmp_path, dataset=data.rename_column("sentiment", "label")).planned_steps > 0


def test_string_labels_are_refused_with_the_mapping_to_apply_and_it_builds(tmp_path):
    names = ("negative", "positive")
    data = tiny.sentiment_dataset(96).map(lambda row: {"label": names[row["label"]]})
    with pytest.raises(ValueError, match="labels must be integer class ids") as refused:
        make_trainer(tmp_path, dataset=data)
    mapping = re.search(r"label2id = (\{.*?\})", str(refused.value)).group(1)
    assert mapping == "{'negative': 0, 'positive': 1}"
    label2id = ast.literal_eval(mapping)
    fixed = data.map(lambda row: {"label": label2id[row["label"]]})
    assert fixed["label"] == tiny.sentiment_dataset(96)["label"]
    assert make_trainer(tmp_path, dataset=fixed).planned_steps > 0


def test_the_mapping_shown_is_the_models_own_when_it_names_every_value():
    model = tiny.bert(label2id={"pos": 0, "neg": 1}, id2label={0: "pos", 1: "neg"})
    with pytest.raises(ValueError, match=r"\(the model's config.label2id\): label2id = \{'neg': 1, 'pos': 0\}"):
        refuse_string_labels(Dataset.from_dict({"label": ["pos", "neg", "pos"]}), model)
    with pytest.raises(ValueError, match=r"in sorted order\): label2id = \{'a': 0, 'b': 1, 'c': 2\}.*num_labels=2"):
        refuse_string_labels(Dataset.from_dict({"label": ["c", "a", "b"]}), tiny.bert())  # LABEL_0, LABEL_1: default


def test_token_labels_and_dataset_items_are_read_and_a_text_column_gets_no_mapping():
    items = [{"input_ids": [1, 2], "labels": ["O", "B-PER"]}, {"input_ids": [3], "labels": ["I-PER"]}]
    assert string_labels(items) == ("labels", ["B-PER", "I-PER", "O"], "tokens")
    with pytest.raises(ValueError, match=r"over its tokens.*\[label2id\[t\] for t in row\['labels'\]\]"):
        refuse_string_labels(items, tiny.bert())
    assert string_labels(Dataset.from_dict({"labels": [["O"], ["B-PER", "O"]]})) == ("labels", ["B-PER", "O"], "tokens")
    assert string_labels(tiny.sentiment_dataset(8)) is None and string_labels([{"label": 1}]) is None
    texts = Dataset.from_dict({"label": [f"review {i}" for i in range(MAX_CLASS_NAMES_SHOWN + 1)]})
    with pytest.raises(ValueError, match="not class names") as refused:
        refuse_string_labels(texts, tiny.bert())
    assert "review" not in str(refused.value)  # no value of a row in a message that may reach shared logs


class _DrawingCollator(DataCollatorWithPadding):
    """A collator that draws from every global random stream, as masking collators do."""

    def __call__(self, features):
        torch.rand(1), random.random(), np.random.rand()
        return super().__call__(features)


def test_mutation_collating_at_construction_leaves_every_random_stream_as_it_was(tmp_path, monkeypatch):
    """The first example is collated when the trainer is built; a collator that draws must not shift the seeded
    streams training then reads (dropout, masks). Without `_random_state_kept` the states differ."""

    def states():
        return torch.get_rng_state(), random.getstate(), np.random.get_state()[1]

    def build(collator_class):
        tok = tiny.tokenizer()
        PrivateTrainer(
            model=tiny.bert(),
            args=training_args(tmp_path),
            train_dataset=tiny.sentiment_dataset(96),
            data_collator=collator_class(tok),
            processing_class=tok,
            dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        )
        return states()

    plain, drawing = build(DataCollatorWithPadding), build(_DrawingCollator)
    assert torch.equal(plain[0], drawing[0]) and plain[1] == drawing[1] and (plain[2] == drawing[2]).all()
    monkeypatch.setattr(label_checks, "_random_state_kept", contextlib.nullcontext)
    mutated = build(_DrawingCollator)
    assert not torch.equal(plain[0], mutated[0])


def test_a_collator_failing_at_construction_says_when_it_ran(tmp_path):
    data = tiny.sentiment_dataset(96).map(lambda row: {"note": "free text"})
    with pytest.raises(ValueError) as refused:
        make_trainer(tmp_path, dataset=data, remove_unused_columns=False)
    assert "collating the first training example when the trainer was built" in "".join(refused.value.__notes__)
