"""GLUE metrics as a local `evaluate` module: `evaluate.load(path_to_this_file, task)`.

The same numbers as the Hub's `glue` metric (accuracy, F1 of the positive class, Matthews correlation, Pearson and
Spearman correlation) computed with numpy and scipy, so that evaluation works offline and without scikit-learn.
Classification tasks always report accuracy too. One import per line: evaluate scans imports textually.
"""

import datasets
import evaluate
import numpy as np
from scipy import stats

_DESCRIPTION = "GLUE metrics (Wang et al., 2019) offline: accuracy, F1, Matthews correlation, Pearson/Spearman."
_CITATION = """@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={ICLR}, year={2019}}"""
_INPUTS = """predictions: predicted labels (class ids; similarity scores for stsb). references: gold labels.
Returns accuracy for every classification task, plus f1 (mrpc, qqp) or matthews_correlation (cola);
pearson and spearmanr for stsb."""

CLASSIFICATION = ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "mrpc", "qqp", "cola", "ax")
REGRESSION = ("stsb",)


def accuracy(predictions, references):
    return float((predictions == references).mean())


def f1_positive(predictions, references):
    """F1 of class 1 (GLUE's MRPC/QQP convention); 0 when the class is never predicted nor present."""
    tp = int(((predictions == 1) & (references == 1)).sum())
    fp = int(((predictions == 1) & (references != 1)).sum())
    fn = int(((predictions != 1) & (references == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_correlation(predictions, references):
    """Multi-class Matthews correlation (Gorodkin's R_K); 0 when either side has a single class."""
    classes = np.union1d(predictions, references)
    index = {c: i for i, c in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    for truth, guess in zip(references, predictions):
        confusion[index[truth], index[guess]] += 1
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    correct, total = np.trace(confusion), confusion.sum()
    numerator = correct * total - predicted_counts @ true_counts
    spread_predicted = total**2 - predicted_counts @ predicted_counts
    spread_true = total**2 - true_counts @ true_counts
    denominator = np.sqrt(spread_predicted) * np.sqrt(spread_true)
    return float(numerator / denominator) if denominator else 0.0


class GlueMetric(evaluate.Metric):
    def _info(self):
        if self.config_name not in CLASSIFICATION + REGRESSION:
            raise KeyError(f"Unknown GLUE task {self.config_name!r}; expected one of {CLASSIFICATION + REGRESSION}.")
        dtype = "float32" if self.config_name in REGRESSION else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if self.config_name in REGRESSION:
            return {
                "pearson": float(stats.pearsonr(predictions, references)[0]),
                "spearmanr": float(stats.spearmanr(predictions, references)[0]),
            }
        result = {"accuracy": accuracy(predictions, references)}
        if self.config_name in ("mrpc", "qqp"):
            result["f1"] = f1_positive(predictions, references)
        if self.config_name == "cola":
            result["matthews_correlation"] = matthews_correlation(predictions, references)
        return result
