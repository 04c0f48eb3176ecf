"""Encoder-decoder models build like any other; what is still refused is a parameter used without a batch dimension.

T5's `relative_attention_bias` is looked up with [query, key] position buckets shared by every example; its rule
(engine/layers/relative_position_bias.py) hands the first layer's attention the bias expanded to the chunk's rows,
so it trains (tests/models/test_encoder_decoder.py). UMT5 computes a bias in every layer from an embedding of its
own, which no rule claims: the embedding rule sees [q, k] ids, no per-example batch dimension. When the query length
equals the chunk's size its shape is that of a per-example lookup, so the refusal must not rest on shapes alone: the
engine remembers a layer once seen without a batch dimension, and the independence probe (one example alone,
unpadded) reveals it before anything is released.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
    T5ForSequenceClassification,
    T5ForTokenClassification,
    UMT5Config,
    UMT5ForTokenClassification,
)

from hf_private import DPConfig, PrivateTrainer
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot, training_args

CHUNK = 8  # per_device_train_batch_size; the T5 batches below are padded to as many tokens as the chunk has examples
BIAS = "relative_attention_bias"


def _t5_config(**kw) -> T5Config:
    return T5Config(
        vocab_size=tiny.VOCAB_SIZE,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        **kw,
    )


def _bart_config(**kw) -> BartConfig:
    return BartConfig(
        vocab_size=tiny.VOCAB_SIZE,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=tiny.SEQ_LEN + 4,
        dropout=0.0,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=2,
    )


def _token_classifier(family: str, freeze_bias: bool) -> T5ForTokenClassification | UMT5ForTokenClassification:
    """An encoder-only T5 or UMT5 (config.is_encoder_decoder=False), every parameter trainable but the bias if asked."""
    torch.manual_seed(0)
    if family == "t5":
        model = T5ForTokenClassification(_t5_config(num_labels=3))
    else:
        model = UMT5ForTokenClassification(UMT5Config(**_t5_config(num_labels=3).to_dict()))
    for name, p in model.named_parameters():
        if freeze_bias and BIAS in name:
            p.requires_grad_(False)
    return model


FORMERLY_REFUSED = {  # encoder-decoder set-ups refused whole until issue 47, whatever was frozen
    "t5-lm": lambda: T5ForConditionalGeneration(_t5_config()),
    "t5-seq-cls": lambda: T5ForSequenceClassification(_t5_config()),
    "t5-lora": lambda: get_peft_model(
        T5ForConditionalGeneration(_t5_config()),
        LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, lora_alpha=8, lora_dropout=0.0),
    ),
    "bart-seq-cls": lambda: BartForSequenceClassification(_bart_config()),
    "bart-lm": lambda: BartForConditionalGeneration(_bart_config()),
}


@pytest.mark.parametrize("name", list(FORMERLY_REFUSED))
def test_encoder_decoder_models_build_with_a_rule_for_every_trainable_module(tmp_path, name):
    """The private trainer is built, and the engine finds a per-example rule for every trainable module."""
    model = FORMERLY_REFUSED[name]()
    make_trainer(tmp_path, model=model)
    engine = PerExampleGradientEngine(model, 1.0)
    assert not any("generic" in line for line in engine.rule_lines())  # dedicated or matched rules only


def _token_batch(examples: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tiny.VOCAB), (examples, length), generator=gen)
    mask = torch.ones(examples, length, dtype=torch.long)
    mask[1, length // 2 :] = 0  # one example with right padding
    ids[mask == 0] = 0
    labels = torch.randint(0, 3, (examples, length), generator=gen).masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"]).sum()


def test_umt5_relative_attention_bias_is_refused_and_stays_refused_when_shapes_coincide():
    """Chunk 1 (6 examples, 4 positions) shows the [q, k] lookup; chunk 2 (4 examples, 4 positions) would pass."""
    model = _token_classifier("umt5", freeze_bias=False).double()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    for examples in (6, 4):
        with engine.recording(examples):
            _loss(model, _token_batch(examples, 4)).backward()
        with pytest.raises(
            UnsupportedLayerError,
            match=rf"{BIAS} \(Embedding\) is used without a per-example "
            r"batch dimension.*Freeze these parameters",
        ):
            engine.finish_backward()
        assert not engine.clipped_sums and all(p.grad is None for _, p in engine.parameters)


def _token_dataset(n: int) -> Dataset:
    """Sentiment sentences with a label per token: 1 positive word, 2 negative word, 0 otherwise."""
    tok = tiny.tokenizer()
    base = tiny.sentiment_dataset(n)
    positive = set(tok.convert_tokens_to_ids(tiny.POSITIVE))
    negative = set(tok.convert_tokens_to_ids(tiny.NEGATIVE))
    labels = [[1 if t in positive else 2 if t in negative else 0 for t in ids] for ids in base["input_ids"]]
    return Dataset.from_dict(
        {"input_ids": base["input_ids"], "attention_mask": base["attention_mask"], "labels": labels}
    )


def _pad_to_chunk_size(features: list[dict]) -> dict[str, torch.Tensor]:
    """Pad (or cut) every example to as many tokens as the first chunk has examples: [q, k] looks like [B, T]."""
    length = min(len(features), CHUNK)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        ids = list(f["input_ids"])[:length]
        pad = length - len(ids)
        out["input_ids"].append(ids + [0] * pad)
        out["attention_mask"].append([1] * len(ids) + [0] * pad)
        out["labels"].append(list(f["labels"])[:length] + [-100] * pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def _t5_trainer(tmp_path, model) -> PrivateTrainer:
    return PrivateTrainer(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=CHUNK, max_steps=2),
        train_dataset=_token_dataset(32),
        data_collator=_pad_to_chunk_size,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
    )


def test_trainable_umt5_relative_attention_bias_is_refused_before_any_step(tmp_path):
    """Sequence length == chunk size: the shapes pass, the probe (one example alone, unpadded) must refuse."""
    model = _token_classifier("umt5", freeze_bias=False)
    trainer = _t5_trainer(tmp_path, model)
    before = snapshot(model)
    with pytest.raises(
        UnsupportedLayerError,
        match=rf"SelfAttention\.{BIAS} \(Embedding\) is used without a "
        r"per-example batch dimension .*where its chunk held 1 example\)"
        r".*Freeze these parameters",
    ):  # found by the probe
        trainer.train()
    assert trainer.ledger.total_steps == 0
    after = snapshot(model)
    assert all(torch.equal(v, after[k]) for k, v in before.items()), "nothing may be released"


@pytest.mark.parametrize(
    "family, freeze_bias", [("umt5", True), ("t5", False)], ids=["umt5-bias-frozen", "t5-bias-trains"]
)
def test_the_same_set_up_trains_with_umt5s_bias_frozen_or_t5s_bias_trainable(tmp_path, family, freeze_bias):
    """Following the message (UMT5's bias frozen), or with T5's rule, the same set-up trains; the probe passes."""
    model = _token_classifier(family, freeze_bias)
    trainer = _t5_trainer(tmp_path, model)
    trainer.train()
    assert trainer.ledger.total_steps == 2 and not trainer.privacy_run.needs_independence_probe


@pytest.mark.parametrize("family, freeze_bias", [("umt5", True), ("t5", False)], ids=["umt5-bias-frozen", "t5"])
def test_encoder_only_t5_matches_the_fp64_per_example_loop(family, freeze_bias):
    """Encoder-only (U)T5, everything trainable but UMT5's bias, 6 examples of 6 positions: norms and clipped sums
    exact (T5's bias too: its [q, k] lookup has the chunk's shape)."""
    examples = length = 6
    model = _token_classifier(family, freeze_bias).double()
    model.train()
    batch = _token_batch(examples, length)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for b in range(examples):
        model.zero_grad()
        _loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad()
    ref_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    clip = 0.5 * ref_norms.min().item()
    factors = [min(1.0, clip / (n.item() + 1e-6)) for n in ref_norms]
    ref_sum = torch.cat([sum(f * gs[i] for f, gs in zip(factors, grads)).flatten() for i in range(len(params))])

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    for verified in (False, True):  # the autograd-checked chunk, then ghost differentiation
        assert engine.verified is verified
        with engine.recording(examples):
            _loss(model, batch).backward()
        norms = engine.finish_backward()
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
        sums = engine.pop_clipped_sums()
        ours = torch.cat([sums[p].flatten() for p in params])
        assert ((ours - ref_sum).norm() / ref_sum.norm()).item() <= 1e-6
    engine.detach()
