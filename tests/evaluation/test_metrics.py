"""The shipped GLUE metric loads through `evaluate` offline and gives the textbook numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_private.evaluation.metrics import load_glue_metric


def test_binary_tasks_report_accuracy_f1_and_matthews():
    predictions, references = [1, 1, 0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 1, 1, 1, 1]
    tp, tn, fp, fn = 4, 2, 1, 1
    assert load_glue_metric("sst2").compute(predictions=predictions, references=references) == {"accuracy": 0.75}
    mrpc = load_glue_metric("mrpc").compute(predictions=predictions, references=references)
    assert mrpc == pytest.approx({"accuracy": 0.75, "f1": 2 * tp / (2 * tp + fp + fn)})
    cola = load_glue_metric("cola").compute(predictions=predictions, references=references)
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert cola == pytest.approx({"accuracy": 0.75, "matthews_correlation": mcc})


def test_multiclass_matthews_and_degenerate_cases():
    mnli = load_glue_metric("mnli").compute(predictions=[0, 1, 2, 2, 1, 0], references=[0, 1, 2, 1, 1, 2])
    assert mnli == {"accuracy": pytest.approx(4 / 6)}
    # Gorodkin's R_K for this confusion matrix, computed by hand: rows truth, columns prediction.
    from hf_private.evaluation.metrics.glue_metric import matthews_correlation

    value = matthews_correlation(np.array([0, 1, 2, 2, 1, 0]), np.array([0, 1, 2, 1, 1, 2]))
    assert value == pytest.approx((4 * 6 - (2 * 1 + 2 * 3 + 2 * 2)) / math.sqrt((36 - 12) * (36 - 14)))
    constant = load_glue_metric("cola").compute(predictions=[1, 1, 1], references=[0, 1, 1])
    assert constant["matthews_correlation"] == 0.0


def test_stsb_reports_pearson_and_spearman():
    predictions, references = [0.5, 2.0, 3.5, 4.0, 1.0], [0.0, 2.5, 3.0, 5.0, 1.5]
    result = load_glue_metric("stsb").compute(predictions=predictions, references=references)
    assert result["pearson"] == pytest.approx(np.corrcoef(predictions, references)[0, 1])
    assert result["spearmanr"] == pytest.approx(1.0)


def test_unknown_task_is_refused():
    with pytest.raises(KeyError, match="Unknown GLUE task"):
        load_glue_metric("squad")
