"""The recipe's embedded offline default: the generated sentiment task of `hf_private.demos.sentiment` and a small BERT.

It exists so that `python recipes/glue.py` runs a complete private fine-tune on a fresh machine with no network
and no data; it is a demo of the pipeline, not a benchmark.
"""

from __future__ import annotations

from hf_private.demos.sentiment import LABEL_NOISE, MAX_LENGTH, demo_model, demo_tokenizer, sentiment_splits

__all__ = ["LABEL_NOISE", "MAX_LENGTH", "demo_model", "demo_tokenizer", "sentiment_splits"]
