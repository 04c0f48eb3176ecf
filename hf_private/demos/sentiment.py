"""The generated sentiment task behind every offline demo: the GLUE recipe's, the audit command's and the tests'.

A review is a few neutral words and one to three sentiment words, shuffled; its label is the sentiment's. It needs
no download, and a small BERT built from config learns it in seconds. The recipe's demo asks for a harder variant
(`contrast`, `label_noise`), on which privacy visibly costs accuracy. It shows that the pipeline works; it is not a
benchmark.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

POSITIVE = ("good", "great", "fine", "nice", "happy", "love", "superb", "bright")
NEGATIVE = ("bad", "awful", "poor", "sad", "hate", "dull", "broken", "worse")
NEUTRAL = ("the", "a", "movie", "plot", "was", "it", "and", "very", "this", "film", "story", "actor")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
VOCAB = (*SPECIAL, *POSITIVE, *NEGATIVE, *NEUTRAL)
MAX_LENGTH = 16  # tokens: the longest review has 11


def demo_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the demo vocabulary, built in memory."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=MAX_LENGTH,
    )


def sentiment_texts(
    n: int,
    seed: int = 0,
    *,
    contrast: bool = False,
    label_noise: float = 0.0,
) -> tuple[list[str], list[int]]:
    """`n` generated reviews and their labels (1 positive, 0 negative), the same for the same seed.

    The defaults give the easy task the tests rely on: any sentiment word gives the label away. `contrast`: words of
    both sentiments may occur, and the last one decides (a verdict after a "but"), so the model must use word order.
    `label_noise`: the share of labels flipped, in training and held-out data alike, as in real data; no model then
    beats about 1 - label_noise, and no held-out loss reaches 0.
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randint(0, 1)
        own, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        if contrast:
            words = rng.choices(NEUTRAL, k=rng.randint(3, 7))
            count = rng.randint(1, 3)
            sentiment = [rng.choice(rng.choice((own, other))) for _ in range(count - 1)] + [rng.choice(own)]
            for position, word in zip(sorted(rng.sample(range(len(words) + count), count)), sentiment):
                words.insert(position, word)  # ascending positions: each word lands where drawn, in order
        else:
            words = rng.choices(NEUTRAL, k=rng.randint(3, 8)) + rng.choices(own, k=rng.randint(1, 3))
            rng.shuffle(words)
        if label_noise and rng.random() < label_noise:
            label = 1 - label
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


def sentiment_dataset(n: int, seed: int = 0) -> Dataset:
    """`sentiment_texts` tokenized: input_ids, attention_mask and label columns."""
    texts, labels = sentiment_texts(n, seed)
    enc = demo_tokenizer()(texts, truncation=True, max_length=MAX_LENGTH)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "label": labels})


# The demo's share of flipped labels: held-out accuracy stays below about 1 - LABEL_NOISE, the loss above 0.
LABEL_NOISE = 0.05


def sentiment_splits(train_size: int = 10000, validation_size: int = 1000, seed: int = 1234) -> DatasetDict:
    """Raw `sentence`/`label` "train" and "validation" splits, laid out like GLUE SST-2 so a script swaps one for the
    other: the harder task (`contrast`, `LABEL_NOISE`), so the demo shows what privacy costs. A validation review
    that also occurs in training is left out (so slightly fewer than `validation_size` remain): the trainer would
    rightly refuse to call the split held-out."""
    texts, labels = sentiment_texts(train_size + validation_size, seed, contrast=True, label_noise=LABEL_NOISE)
    seen = set(texts[:train_size])
    held_out = [i for i in range(train_size, len(texts)) if texts[i] not in seen]
    return DatasetDict(
        {
            "train": Dataset.from_dict({"sentence": texts[:train_size], "label": labels[:train_size]}),
            "validation": Dataset.from_dict(
                {"sentence": [texts[i] for i in held_out], "label": [labels[i] for i in held_out]}
            ),
        }
    )


def demo_model(num_labels: int = 2, **config: Any) -> BertForSequenceClassification:
    """A small BERT for the demo vocabulary, built from config (`config` overrides its fields).

    Seeded, so the same "base model" can be rebuilt to load a saved adapter onto.
    """
    torch.manual_seed(0)
    fields = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_LENGTH + 2,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(BertConfig(**{**fields, **config}))
