"""The recipe's embedded offline default: the generated sentiment task of `hf_private.demo` and a small BERT.

It exists so that `python recipes/glue.py` runs a complete private fine-tune on a fresh machine with no network
and no data; it is a demo of the pipeline, not a benchmark.
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict

from hf_private.demo import MAX_LENGTH, demo_model, demo_tokenizer, sentiment_texts

__all__ = ["MAX_LENGTH", "demo_dataset", "demo_model", "demo_tokenizer"]


# Harder than the tests' default task, so that the demo shows what privacy costs: reviews may hold both sentiments
# (the last word decides) and 5% of labels are flipped, so held-out accuracy stays below 1 and the loss above 0.
LABEL_NOISE = 0.05


def demo_dataset(train_size: int = 10000, validation_size: int = 1000, seed: int = 1234) -> DatasetDict:
    """Raw `sentence`/`label` splits. A validation review that also occurs in training is left out (so slightly
    fewer than `validation_size` remain): the trainer would rightly refuse to call the split held-out."""
    texts, labels = sentiment_texts(train_size + validation_size, seed, contrast=True, label_noise=LABEL_NOISE)
    seen = set(texts[:train_size])
    held_out = [i for i in range(train_size, len(texts)) if texts[i] not in seen]
    return DatasetDict({
        "train": Dataset.from_dict({"sentence": texts[:train_size], "label": labels[:train_size]}),
        "validation": Dataset.from_dict({"sentence": [texts[i] for i in held_out],
                                         "label": [labels[i] for i in held_out]}),
    })
