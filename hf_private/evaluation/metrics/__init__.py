"""Metrics shipped with hf_private as `evaluate` modules, because `evaluate.load("glue", ...)` needs the Hub."""

from __future__ import annotations

from pathlib import Path

GLUE_METRIC_PATH = str(Path(__file__).with_name("glue_metric.py"))


def load_glue_metric(task: str):
    """The GLUE metric of `task` (accuracy, F1, Matthews correlation or Pearson/Spearman), loaded from a local file.

    `keep_in_memory` keeps evaluate from sharing a cache file between the processes of a multi-process launch.
    """
    import evaluate

    return evaluate.load(GLUE_METRIC_PATH, task, keep_in_memory=True)


__all__ = ["GLUE_METRIC_PATH", "load_glue_metric"]
