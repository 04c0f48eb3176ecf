"""The recipe's embedded offline default: a generated review-sentiment task and a small BERT built from config.

It exists so that `python recipes/glue.py` runs a complete private fine-tune on a fresh machine with no network
and no data; it is a demo of the pipeline, not a benchmark.
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

POSITIVE = ("good great excellent superb wonderful lovely charming delightful moving brilliant fun clever "
            "engaging beautiful touching").split()
NEGATIVE = ("bad awful terrible boring dull poor weak tedious clumsy messy bland painful lifeless silly "
            "forgettable").split()
NEUTRAL = ("the a this that film movie story plot actor cast scene script ending music it was is and with "
           "very quite rather somewhat really too its of").split()
NEGATORS = ("not", "never")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
MAX_LENGTH = 24


def demo_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate((*SPECIAL, *POSITIVE, *NEGATIVE, *NEUTRAL, *NEGATORS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=MAX_LENGTH)


def _review(rng: random.Random) -> tuple[str, int]:
    label = rng.randint(0, 1)
    words = rng.choices(NEUTRAL, k=rng.randint(4, 10))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.15:  # "not good" reads negative: the model must look at word order a little
            words += [rng.choice(NEGATORS), rng.choice(NEGATIVE if label else POSITIVE)]
        else:
            words.append(rng.choice(POSITIVE if label else NEGATIVE))
    rng.shuffle(words[:-2])
    return " ".join(words), label


def demo_dataset(train_size: int = 20000, validation_size: int = 1000, seed: int = 1234) -> DatasetDict:
    rng = random.Random(seed)
    splits = {}
    for split, size in (("train", train_size), ("validation", validation_size)):
        sentences, labels = zip(*(_review(rng) for _ in range(size)))
        splits[split] = Dataset.from_dict({"sentence": list(sentences), "label": list(labels)})
    return DatasetDict(splits)


def demo_model(num_labels: int = 2) -> BertForSequenceClassification:
    """Seeded, so the same "base model" can be rebuilt to load a saved adapter onto."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(demo_tokenizer()), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_LENGTH + 2, num_labels=num_labels)
    return BertForSequenceClassification(config)
