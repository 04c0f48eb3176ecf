"""The generated instruction task behind the offline SFT recipe (`recipes/sft.py`): prompt-completion pairs, a
word-level tokenizer and a small Llama built from config, all in memory (no files, no network).

A prompt is an instruction word and a generated review (`hf_private.demos.sentiment.sentiment_texts`, the word-order
variant);
the completion is a simple function of the review:

* ``verdict : <review>`` → ``good`` or ``bad``, the sentiment of the review's last sentiment word;
* ``last : <review>`` → the review's last word, copied;
* ``first : <review>`` → the review's first word, copied.

A 2-layer model of width 64 learns it in seconds without privacy, and visibly at ε = 8. Held-out exact match of the
greedy completion is the metric; the trivial baseline (one fixed answer per instruction) is `majority_exact_match`.
For DPO each prompt comes with the right completion (chosen) and a plausible wrong one (rejected: the other verdict,
or the review's other end), `preference_splits`.
It shows that the pipeline works; it is not a benchmark.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .sentiment import NEGATIVE, NEUTRAL, POSITIVE, sentiment_texts

INSTRUCTIONS = ("verdict", "last", "first")
VERDICTS = ("bad", "good")
SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>")
VOCAB = (*SPECIAL, *INSTRUCTIONS, ":", *POSITIVE, *NEGATIVE, *NEUTRAL)
MAX_LENGTH = 24  # tokens: the longest prompt with its completion and <eos> has 16


def instruction_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the task's words, built in memory; TRL ends every completion with its <eos>."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=MAX_LENGTH,
    )


def answer(instruction: str, review: str, label: int) -> str:
    """The completion the task asks for."""
    words = review.split()
    if instruction == "verdict":
        return VERDICTS[label]
    return words[-1] if instruction == "last" else words[0]


def instruction_pairs(n: int, seed: int = 0) -> dict[str, list[str]]:
    """`n` prompt-completion pairs, the same for the same seed; the completion starts with a space, as TRL joins
    prompt and completion by concatenation."""
    rng = random.Random(seed)
    reviews, labels = sentiment_texts(n, seed, contrast=True)
    prompts, completions = [], []
    for review, label in zip(reviews, labels):
        instruction = rng.choice(INSTRUCTIONS)
        prompts.append(f"{instruction} : {review}")
        completions.append(f" {answer(instruction, review, label)}")
    return {"prompt": prompts, "completion": completions}


def wrong_answer(instruction: str, review: str, label: int) -> str:
    """A plausible wrong completion: the other verdict, or the word at the review's other end."""
    words = review.split()
    if instruction == "verdict":
        return VERDICTS[1 - label]
    return words[0] if instruction == "last" else words[-1]


def preference_pairs(n: int, seed: int = 0) -> dict[str, list[str]]:
    """`n` prompts, each with the right completion (chosen) and a wrong one (rejected); when a review's first and
    last words are the same, the rejected completion is the other verdict word, so the two always differ."""
    rng = random.Random(seed)
    reviews, labels = sentiment_texts(n, seed, contrast=True)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for review, label in zip(reviews, labels):
        instruction = rng.choice(INSTRUCTIONS)
        chosen, rejected = answer(instruction, review, label), wrong_answer(instruction, review, label)
        if rejected == chosen:
            rejected = VERDICTS[0] if chosen != VERDICTS[0] else VERDICTS[1]
        rows["prompt"].append(f"{instruction} : {review}")
        rows["chosen"].append(f" {chosen}")
        rows["rejected"].append(f" {rejected}")
    return rows


def instruction_splits(train_size: int = 4000, validation_size: int = 200, seed: int = 1234) -> DatasetDict:
    """`prompt`/`completion` "train" and "validation" splits; a validation prompt that also occurs in training is left
    out (so slightly fewer than `validation_size` may remain), so the split is truly held out."""
    return _held_out_splits(instruction_pairs(train_size + validation_size, seed), train_size, validation_size)


def preference_splits(train_size: int = 4000, validation_size: int = 200, seed: int = 1234) -> DatasetDict:
    """`prompt`/`chosen`/`rejected` "train" and "validation" splits, held out as `instruction_splits` are."""
    return _held_out_splits(preference_pairs(train_size + validation_size, seed), train_size, validation_size)


def _held_out_splits(pairs: dict[str, list[str]], train_size: int, validation_size: int) -> DatasetDict:
    seen = set(pairs["prompt"][:train_size])
    held_out = [i for i in range(train_size, train_size + validation_size) if pairs["prompt"][i] not in seen]
    return DatasetDict(
        {
            "train": Dataset.from_dict({k: v[:train_size] for k, v in pairs.items()}),
            "validation": Dataset.from_dict({k: [v[i] for i in held_out] for k, v in pairs.items()}),
        }
    )


def majority_exact_match(train: Dataset, validation: Dataset, column: str = "completion") -> float:
    """The trivial baseline: per instruction, always answer the training set's most common completion (`column`:
    "chosen" for preference pairs)."""
    common: dict[str, Counter] = {}
    for prompt, completion in zip(train["prompt"], train[column]):
        common.setdefault(prompt.split()[0], Counter())[completion.strip()] += 1
    best = {instruction: counts.most_common(1)[0][0] for instruction, counts in common.items()}
    hits = [best.get(p.split()[0]) == c.strip() for p, c in zip(validation["prompt"], validation[column])]
    return sum(hits) / max(1, len(hits))


def instruction_model(**config: Any) -> LlamaForCausalLM:
    """A small Llama (2 layers, width 64) for the task's vocabulary, built from config (`config` overrides fields).

    Seeded, so the same "base model" is rebuilt for the private and the non-private run, and to reload an adapter.
    """
    torch.manual_seed(0)
    fields = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_LENGTH + 8,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config}))
