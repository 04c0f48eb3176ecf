"""A training example stored another way is still a training example: padding, max_length and re-tokenisation.

Each overlap below counted 0 rows when rows were compared by a hash of their stored columns.
"""

from __future__ import annotations

import random

from datasets import Dataset
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from hf_private.demos import sentiment as demo
from hf_private.evaluation.held_out import TrainingRows
from hf_private.evaluation.row_identity import MIN_PREFIX
from tests.support import tiny

INPUTS = ["input_ids", "attention_mask", "label"]  # what the model accepts, as Trainer lists it
WORDS = [*tiny.POSITIVE, *tiny.NEGATIVE, *tiny.NEUTRAL]


def _encoded(tok, texts: list[str], labels: list[int], **kw) -> Dataset:
    enc = tok(texts, truncation=True, **kw)
    return Dataset.from_dict({**{key: enc[key] for key in enc if key in INPUTS}, "label": labels})


def _bert_style() -> PreTrainedTokenizerFast:
    """The demo tokenizer with [CLS] ... [SEP] around each text, as BERT's: truncation keeps the [SEP]."""
    tok = tiny.tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


def _long_texts(n: int, seed: int) -> list[str]:
    """Texts of 30 to 40 words: any max_length below 32 truncates every one."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(30, 40))) for _ in range(n)]


def test_padded_copy_is_training_data():
    texts, labels = demo.sentiment_texts(40)
    rows = TrainingRows(tiny.sentiment_dataset(40), INPUTS, pad_token_id=0)
    padded = _encoded(tiny.tokenizer(), texts, labels, padding="max_length", max_length=16)
    assert rows.overlap(padded, "padded").shared == 40
    unmasked = _encoded(
        tiny.tokenizer(), texts, labels, padding="max_length", max_length=20, return_attention_mask=False
    )
    assert rows.overlap(unmasked, "unmasked").shared == 40, "without a mask, the pad id shows the padding"
    assert rows.overlap(tiny.sentiment_dataset(40, seed=9), "fresh").shared == 0


def test_padded_multiple_choice_copy_is_training_data():
    train = tiny.multiple_choice_dataset(12)
    width = tiny.SEQ_LEN

    def pad(row):
        return {
            "input_ids": [ids + [0] * (width - len(ids)) for ids in row["input_ids"]],
            "attention_mask": [mask + [0] * (width - len(mask)) for mask in row["attention_mask"]],
        }

    rows = TrainingRows(train, INPUTS)
    assert rows.overlap(train.map(pad), "padded").shared == 12
    assert rows.overlap(tiny.multiple_choice_dataset(12, seed=9).map(pad), "fresh").shared == 0


def test_copy_at_another_max_length_is_training_data():
    tok, labels = _bert_style(), [0] * 30
    texts, fresh = _long_texts(30, seed=0), _long_texts(30, seed=1)
    for train_length, eval_length in [(48, 24), (24, 48)]:
        train = _encoded(tok, texts, labels, max_length=train_length, padding="max_length")
        rows = TrainingRows(train, INPUTS, pad_token_id=tok.pad_token_id)
        copy = _encoded(tok, texts[:10] + fresh[10:], labels, max_length=eval_length)
        assert rows.overlap(copy, f"{eval_length} tokens").shared == 10, (train_length, eval_length)
        assert rows.overlap(_encoded(tok, fresh, labels, max_length=eval_length), "fresh").shared == 0


def test_retokenised_text_is_training_data():
    """Same texts through another vocabulary: no token in common, the text column alone shows the copy."""
    texts, labels = demo.sentiment_texts(40)
    train = tiny.sentiment_dataset(40).add_column("sentence", texts)
    reversed_vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(reversed(demo.VOCAB))}, unk_token="[UNK]"))
    reversed_vocab.normalizer = normalizers.Lowercase()
    reversed_vocab.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=reversed_vocab, pad_token="[PAD]", unk_token="[UNK]")
    restyled = [f"  {text.capitalize()}\n" for text in texts]  # case and spacing do not make a new text
    copy = _encoded(other, restyled, labels, padding="max_length", max_length=16).add_column("sentence", restyled)
    assert copy["input_ids"][0] != train["input_ids"][0]
    assert TrainingRows(train, INPUTS).overlap(copy, "re-tokenised").shared == 40


def test_texts_sharing_an_opening_with_training_texts_are_held_out():
    """Short texts one word longer or with another last word: different examples, however padded or stored."""
    texts, labels = demo.sentiment_texts(60)
    train = tiny.sentiment_dataset(60).add_column("sentence", texts).add_column("id", [str(i) for i in range(60)])
    longer = [f"{text} movie" for text in texts[:30]]
    changed = [" ".join([*text.split()[:-1], "plot" if text.split()[-1] != "plot" else "film"]) for text in texts[30:]]
    assert not set(changed) & set(texts)
    near = (
        _encoded(tiny.tokenizer(), longer + changed, labels, padding="max_length", max_length=16)
        .add_column("sentence", longer + changed)
        .add_column("id", [str(i) for i in range(60)])
    )
    assert max(map(len, train["input_ids"])) - 1 < MIN_PREFIX  # too short an opening to call a copy
    assert TrainingRows(train, INPUTS, pad_token_id=0).overlap(near, "near").shared == 0
