"""Held-out predictions that collapse to one class are warned about once, with the likely causes; mixed predictions,
sets that overlap the training data and evaluations before any training step are not."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import DataCollatorWithPadding

from hf_private import BitFitConfig, DPConfig
from hf_private.evaluation.prediction_collapse import MIN_EXAMPLES, HeldOutPredictions, RunSettings, collapse_message
from tests.support import tiny
from tests.support.helpers import make_trainer

COLLAPSED = "collapsed to class"


@pytest.fixture(scope="module")
def data():
    """(training set, held-out set: demo sentences of another seed that repeat no training row)."""
    train = tiny.sentiment_dataset(96)
    seen = {tuple(ids) for ids in train["input_ids"]}
    held_out = tiny.sentiment_dataset(48, seed=7).filter(lambda row: tuple(row["input_ids"]) not in seen)
    assert len(held_out) >= MIN_EXAMPLES and 0.2 < sum(held_out["label"]) / len(held_out) < 0.8
    return train, held_out


def _pooled(model, dataset) -> torch.Tensor:
    batch = DataCollatorWithPadding(tiny.tokenizer())([dict(row) for row in dataset.remove_columns("label")])
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        states = model.eval().bert(**batch).last_hidden_state
    return (states * mask).sum(1) / mask.sum(1)


def _collapsed_head(model, k: int = 1):
    """Every input classified as k."""
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.nn.functional.one_hot(torch.tensor(k), 2).float() * 5)
    return model


def _split_head(model, dataset):
    """Inputs classified by which side of the median they fall along one feature direction: both classes."""
    pooled = _pooled(model, dataset)
    direction = pooled[0] - pooled[1]
    cut = (pooled @ direction).median()
    with torch.no_grad():
        model.classifier.weight.copy_(torch.stack([-direction, direction]))
        model.classifier.bias.copy_(torch.stack([cut, -cut]))
    return model


def _evaluate(tmp_path, model, train, eval_sets, caplog, steps: int = 1, dp=None) -> list[str]:
    """Collapse warnings from evaluating each set after `steps` steps at learning rate 0 (the weights stay)."""
    trainer = make_trainer(tmp_path, model=model, dataset=train, dp=dp, max_steps=max(steps, 1), learning_rate=0.0)
    if steps:
        trainer.train()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for dataset in eval_sets:
            trainer.evaluate(dataset)
    return [r.getMessage() for r in caplog.records if COLLAPSED in r.getMessage() and r.levelno == logging.WARNING]


def test_collapsed_predictions_warn_once_with_the_causes(tmp_path, data, caplog):
    train, held_out = data
    warnings = _evaluate(tmp_path, _collapsed_head(tiny.mean_pooled_bert()), train, [held_out, held_out], caplog)
    assert len(warnings) == 1, "one warning per evaluation set, not one per evaluate()"
    share = sum(held_out["label"]) / len(held_out)
    assert f"collapsed to class 1: 100.0% of {len(held_out)} predictions" in warnings[0]
    assert f"class 1 is {100 * share:.1f}% of the labels" in warnings[0]
    for cause in ("clip norm C=1", "median_gradient_norm", "learning rate (0)", "too few examples"):
        assert cause in warnings[0], cause
    assert "the head" not in warnings[0]  # already the mean-pooled head


def test_mixed_predictions_do_not_warn(tmp_path, data, caplog):
    train, held_out = data
    model = _split_head(tiny.mean_pooled_bert(), held_out)
    batch = DataCollatorWithPadding(tiny.tokenizer())([dict(row) for row in held_out.remove_columns("label")])
    with torch.no_grad():
        predicted = model(**batch).logits.argmax(-1)
    assert 0.3 < predicted.float().mean() < 0.7  # the precondition: both classes predicted
    assert _evaluate(tmp_path, model, train, [held_out], caplog) == []


def test_training_data_and_untrained_models_are_not_checked(tmp_path, data, caplog):
    train, held_out = data
    model = _collapsed_head(tiny.mean_pooled_bert())
    assert _evaluate(tmp_path / "a", model, train, [train], caplog) == []  # overlaps: never counted
    assert _evaluate(tmp_path / "b", model, train, [held_out], caplog, steps=0) == []  # no step: no cause to name


def _outputs(predicted: list[int]) -> SimpleNamespace:
    return SimpleNamespace(logits=torch.nn.functional.one_hot(torch.tensor(predicted), 2).float())


SETTINGS = RunSettings(
    max_grad_norm=0.1, learning_rate=5e-4, examples=1000, trained_values=10, model_values=100, steps=40
)


@pytest.mark.parametrize(
    "labels, problem, warned",
    [
        ([0, 1] * 15, None, True),
        ([1] * 30, None, False),  # the labels are one class: predicting it is right
        ([0] * 2 + [1] * 18, None, False),  # 90% of the labels: following an imbalanced prior is not a collapse
        ([0] * 6 + [1] * 14, None, True),  # 70% of the labels, all of the predictions
        ([0, 1] * 5, None, False),  # fewer than MIN_EXAMPLES
        ([0.0, 1.0] * 15, "regression", False),  # not single-label classification: not counted
    ],
)
def test_what_counts_as_collapsed(labels, problem, warned, caplog):
    model = tiny.bert(problem_type=problem)
    counts = HeldOutPredictions()
    with counts.counting(held_out=True):
        counts.add(model, _outputs([1] * len(labels)), torch.tensor(labels))
    with caplog.at_level(logging.WARNING):
        assert counts.warn_if_collapsed("eval", model, SETTINGS) == warned


def test_causes_fit_the_run():
    cls_head = collapse_message("eval", 1, 1.0, 872, 0.509, tiny.bert(), SETTINGS)
    assert "BertForSequenceClassification classifies the CLS token" in cls_head
    assert "MeanPooledBertForSequenceClassification.from_pretrained(path)" in cls_head
    assert "too few examples" not in cls_head  # 10 of 100 values train
    full = RunSettings(**{**SETTINGS.__dict__, "trained_values": 100})
    assert "too few examples for the noised coordinates: 100 trained values" in collapse_message(
        "eval", 1, 1.0, 872, 0.509, tiny.mean_pooled_bert(), full
    )


def test_bitfit_run_names_no_data_shortage(tmp_path, data, caplog):
    train, held_out = data
    warnings = _evaluate(
        tmp_path,
        _collapsed_head(tiny.mean_pooled_bert()),
        train,
        [held_out],
        caplog,
        dp=BitFitConfig(noise_multiplier=1.0),
    )
    assert len(warnings) == 1 and "too few examples" not in warnings[0]


def test_collapse_on_a_dict_of_sets_names_the_set(tmp_path, data, caplog):
    train, held_out = data
    trainer = make_trainer(
        tmp_path,
        model=_collapsed_head(tiny.mean_pooled_bert(), k=0),
        dataset=train,
        dp=DPConfig(noise_multiplier=1.0),
        max_steps=1,
        learning_rate=0.0,
    )
    trainer.train()
    with caplog.at_level(logging.WARNING):
        trainer.evaluate({"dev": held_out})
    assert any("on 'eval_dev' collapsed to class 0" in r.getMessage() for r in caplog.records)
