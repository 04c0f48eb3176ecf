"""Tiny models (hidden 32, 2 layers) built from configs, and the demo task (`demos.sentiment`) with its tokenizer."""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForMultipleChoice,
    RobertaForSequenceClassification,
)

from hf_private.demos import sentiment as demo
from hf_private.models.heads import (
    MeanPooledBertConfig,
    MeanPooledBertForSequenceClassification,
    MeanPooledRobertaConfig,
    MeanPooledRobertaForSequenceClassification,
)

POSITIVE, NEGATIVE, NEUTRAL, SPECIAL = list(demo.POSITIVE), list(demo.NEGATIVE), list(demo.NEUTRAL), list(demo.SPECIAL)
VOCAB = list(demo.VOCAB)
VOCAB_SIZE = 64  # > len(VOCAB): unused rows must still get noise and stay consistent
SEQ_LEN = demo.MAX_LENGTH
tokenizer = demo.demo_tokenizer
sentiment_dataset = demo.sentiment_dataset


def multiple_choice_dataset(n: int, choices: int = 3, seed: int = 0) -> Dataset:
    """Pick the positive ending: each example holds `choices` token rows (context + ending), label = its index."""
    rng = random.Random(seed)
    tok = tokenizer()
    rows, labels = [], []
    for _ in range(n):
        context = " ".join(rng.choices(NEUTRAL, k=rng.randint(2, 6)))
        label = rng.randrange(choices)
        endings = [rng.choice(POSITIVE if c == label else NEGATIVE) for c in range(choices)]
        rows.append(tok([f"{context} {ending}" for ending in endings], truncation=True, max_length=SEQ_LEN))
        labels.append(label)
    return Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "attention_mask": [r["attention_mask"] for r in rows],
            "label": labels,
        }
    )


def lm_dataset(n: int, seed: int = 0) -> Dataset:
    """Token sequences only: DataCollatorForLanguageModeling makes the labels."""
    return sentiment_dataset(n, seed).remove_columns(["label"])


_ENCODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    max_position_embeddings=SEQ_LEN + 4,
)


def bert(**kw) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**{**_ENCODER, **kw}))


def mean_pooled_bert(**kw) -> MeanPooledBertForSequenceClassification:
    torch.manual_seed(0)
    return MeanPooledBertForSequenceClassification(MeanPooledBertConfig(**{**_ENCODER, **kw}))


def mean_pooled_roberta(**kw) -> MeanPooledRobertaForSequenceClassification:
    torch.manual_seed(0)
    return MeanPooledRobertaForSequenceClassification(MeanPooledRobertaConfig(**{**_ENCODER, "pad_token_id": 0, **kw}))


def roberta(**kw) -> RobertaForSequenceClassification:
    torch.manual_seed(0)
    return RobertaForSequenceClassification(RobertaConfig(**{**_ENCODER, "pad_token_id": 0, **kw}))


def roberta_multiple_choice(**kw) -> RobertaForMultipleChoice:
    torch.manual_seed(0)
    return RobertaForMultipleChoice(RobertaConfig(**{**_ENCODER, "pad_token_id": 0, **kw}))


def gpt2(**kw) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=SEQ_LEN + 4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        **kw,
    )
    return GPT2LMHeadModel(config)


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN + 4,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        **kw,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------- SFT: a chat tokenizer, TRL's dataset kinds
CHAT_SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>")  # ids 0-3 as tiny.llama's
# The assistant's turn, its end-of-turn token included, inside {% generation %}: what assistant_only_loss trains.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% else %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the demo words with a chat template whose assistant turns are marked for
    `return_assistant_tokens_mask` (TRL's assistant_only_loss)."""
    vocab = {word: i for i, word in enumerate((*CHAT_SPECIAL, *demo.POSITIVE, *demo.NEGATIVE, *demo.NEUTRAL))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=list(CHAT_SPECIAL[4:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _words(rng, k: int) -> str:
    return " ".join(rng.choice(demo.NEUTRAL) for _ in range(k))


def texts(n: int = 32) -> Dataset:
    """Plain text (TRL's language-modeling kind)."""
    rng = random.Random(0)
    return Dataset.from_dict(
        {"text": [f"{_words(rng, rng.randint(2, 8))} {rng.choice(demo.POSITIVE)}" for _ in range(n)]}
    )


def prompt_completions(n: int = 32) -> Dataset:
    """A prompt and its completion (TRL trains the completion only, by default)."""
    rng = random.Random(1)
    return Dataset.from_dict(
        {
            "prompt": [_words(rng, rng.randint(2, 8)) for _ in range(n)],
            "completion": [f" {rng.choice(demo.POSITIVE)} {rng.choice(demo.NEGATIVE)}" for _ in range(n)],
        }
    )


def preference_pairs(n: int = 32) -> Dataset:
    """A prompt with a chosen and a rejected completion (TRL's DPO kind): positive words chosen, negative rejected."""
    rng = random.Random(3)
    return Dataset.from_dict(
        {
            "prompt": [_words(rng, rng.randint(2, 6)) for _ in range(n)],
            "chosen": [f" {rng.choice(demo.POSITIVE)} {_words(rng, rng.randint(0, 2))}".rstrip() for _ in range(n)],
            "rejected": [f" {rng.choice(demo.NEGATIVE)} {_words(rng, rng.randint(0, 2))}".rstrip() for _ in range(n)],
        }
    )


def conversations(n: int = 32) -> Dataset:
    """A user turn and an assistant turn each (`messages`, through the chat template)."""
    rng = random.Random(2)
    return Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": _words(rng, rng.randint(2, 6))},
                    {
                        "role": "assistant",
                        "content": f"{rng.choice(demo.POSITIVE)} {_words(rng, rng.randint(0, 2))}".strip(),
                    },
                ]
                for _ in range(n)
            ]
        }
    )
