"""Encoder-decoder models (T5, BART) train with full DP: the unit is one (source, target) pair.

Per-example norms and clipped sums are compared with an fp64 loop of one backward per pair, each pair alone and cut
to its own source and target lengths (so padding on either side must not change its gradient). T5's relative
attention bias, shared by every example and broadcast over the batch, gets its per-example gradient from the bias
expanded to the chunk's rows before the attention uses it; BART's learned positions (offset lookup, broadcast [1, T]
in the decoder) from their own rule; the tied shared / encoder / decoder / LM-head embeddings through the engine's
cross terms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_private import DPConfig, privatize
from hf_private.engine import PerExampleGradientEngine
from hf_private.engine.independence import check_example_independence, example_alone
from hf_private.integrations.losses import default_per_example_loss
from hf_private.models.support import with_decoder_inputs
from tests.support import tiny

PAD, BOS, EOS = 0, 2, 3  # the demo tokenizer's [PAD], [CLS], [SEP]
TOL = 1e-6


def t5(**kw) -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=tiny.VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        **kw,
    )
    return T5ForConditionalGeneration(config)


def bart(**kw) -> BartForConditionalGeneration:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=tiny.VOCAB_SIZE,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=tiny.SEQ_LEN + 4,
        dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        forced_eos_token_id=None,
        **kw,
    )
    return BartForConditionalGeneration(config)


def lora(model):
    return get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, lora_alpha=8, lora_dropout=0.0))


def pairs(source_lengths: list[int], target_lengths: list[int], seed: int = 1) -> dict[str, torch.Tensor]:
    """A chunk of (source, target) pairs, each side padded on the right to its longest: source with PAD under an
    attention mask, target with -100 (as DataCollatorForSeq2Seq pads them)."""
    gen = torch.Generator().manual_seed(seed)
    width, target_width = max(source_lengths), max(target_lengths)
    ids = torch.randint(4, len(tiny.VOCAB), (len(source_lengths), width), generator=gen)
    labels = torch.randint(4, len(tiny.VOCAB), (len(target_lengths), target_width), generator=gen)
    mask = (torch.arange(width) < torch.tensor(source_lengths)[:, None]).long()
    target = torch.arange(target_width) < torch.tensor(target_lengths)[:, None]
    return {
        "input_ids": ids.masked_fill(mask == 0, PAD),
        "attention_mask": mask,
        "labels": labels.masked_fill(~target, -100),
    }


def summed_loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    outputs = model(**with_decoder_inputs(model, inputs, batch["labels"]))
    return default_per_example_loss(model, outputs, batch["labels"]).sum()


def pair_alone(batch, b: int) -> dict[str, torch.Tensor]:
    """Pair b by itself, cut to its own source and target lengths."""
    source, target = int(batch["attention_mask"][b].sum()), int(batch["labels"][b].ne(-100).sum())
    return {
        "input_ids": batch["input_ids"][b : b + 1, :source],
        "attention_mask": batch["attention_mask"][b : b + 1, :source],
        "labels": batch["labels"][b : b + 1, :target],
    }


def oracle(model, batch):
    """fp64 per-pair gradients, one backward per pair; the clip below every norm, so every pair is clipped."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for b in range(batch["input_ids"].shape[0]):
        model.zero_grad()
        summed_loss(model, pair_alone(batch, b)).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad()
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    clip = 0.5 * norms.min().item()
    factors = [min(1.0, clip / (n.item() + 1e-6)) for n in norms]
    sums = torch.cat([sum(f * gs[i] for f, gs in zip(factors, grads)).flatten() for i in range(len(params))])
    return norms, sums, params, clip


def engine_errors(model, batch) -> list[tuple[float, float]]:
    """Relative errors of the engine's norms and clipped sums against the oracle: on the chunk checked against
    autograd, then on one under ghost differentiation."""
    model.double().train()
    ref_norms, ref_sums, params, clip = oracle(model, batch)
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    errors = []
    try:
        for verified in (False, True):
            assert engine.verified is verified
            with engine.recording(batch["input_ids"].shape[0]):
                summed_loss(model, batch).backward()
            norms = engine.finish_backward()
            sums = engine.pop_clipped_sums()
            ours = torch.cat([sums[p].flatten() for p in params])
            errors.append(
                (
                    ((norms - ref_norms).abs().max() / ref_norms.max()).item(),
                    ((ours - ref_sums).norm() / ref_sums.norm()).item(),
                )
            )
    finally:
        engine.detach()
    return errors


MODELS = {  # name: (factory, a rule its plan must name)
    "t5": (t5, "relative position bias (per-example bucket sums): 2 module(s) (T5Attention ×2)"),
    "bart": (bart, "learned positions (offset lookup): 2 module(s) (BartLearnedPositionalEmbedding ×2)"),
    "t5-lora": (lambda: lora(t5()), "linear (factored)"),
    "bart-lora": (lambda: lora(bart()), "linear (factored)"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_per_pair_norms_and_clipped_sums_match_the_fp64_oracle(name):
    """Sources of 7, 4, 6, 2 tokens and targets of 3, 5, 1, 4: both sides padded, each pair to other lengths."""
    factory, rule = MODELS[name]
    model = factory()
    assert any(rule in line for line in PerExampleGradientEngine(model, 1.0).rule_lines())
    for norm_error, sum_error in engine_errors(model, pairs([7, 4, 6, 2], [3, 5, 1, 4])):
        assert norm_error <= TOL and sum_error <= TOL


def test_every_tied_embedding_use_and_the_relative_bias_train():
    """Full T5 and BART: the shared embedding (encoder, decoder and LM head) and T5's bias each get a gradient."""
    for model, names in (
        (t5(), ("shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")),
        (bart(), ("model.shared.weight", "model.decoder.embed_positions.weight")),
    ):
        model.double().train()
        by_name = dict(model.named_parameters())
        engine = PerExampleGradientEngine(model, 1e9)  # no clipping: the sums are the gradients
        engine.attach()
        with engine.recording(3):
            summed_loss(model, pairs([5, 3, 4], [4, 2, 3])).backward()
        engine.finish_backward()
        clipped = engine.pop_clipped_sums()
        engine.detach()
        for name in names:
            assert clipped[by_name[name]].norm() > 0, name
        assert "final_logits_bias" not in by_name  # BART's logit bias is a buffer: nothing trains it


@pytest.mark.parametrize("factory", [t5, lambda: lora(t5())], ids=["full", "lora"])
def test_relative_bias_when_the_query_length_equals_the_chunk_size(factory):
    """Four pairs of four source and four target positions: the bias' [q, k] lookup has the chunk's shape."""
    for norm_error, sum_error in engine_errors(factory(), pairs([4, 4, 3, 4], [4, 2, 4, 4])):
        assert norm_error <= TOL and sum_error <= TOL


def test_probe_cuts_the_target_by_its_own_padding_not_the_sources():
    """Source and target padded to the same width (5): the source mask must not cut the labels, or the probe would
    see a pair 'depend on its chunk-mates' that does not."""
    batch = pairs([5, 2, 3, 4], [5, 5, 2, 5])
    alone = example_alone(batch, 1, 4, seq2seq=True)
    assert alone["input_ids"].shape == (1, 2) and torch.equal(alone["labels"], batch["labels"][1:2])
    assert example_alone(batch, 2, 4, seq2seq=True)["labels"].shape == (1, 2)
    model = t5().double()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    check_example_independence(engine, model, batch, summed_loss, 4)
    engine.detach()


def _seq2seq_pairs(n: int, seed: int) -> Dataset:
    """Review → its verdict and a few of its words ("good w1 [SEP]"): targets of 2 to 4 tokens."""
    raw = tiny.sentiment_dataset(n, seed=seed)
    verdict = tiny.tokenizer().convert_tokens_to_ids(["bad", "good"])
    targets = [
        [verdict[y]] + ids[1 : 1 + i % 3] + [EOS] for i, (y, ids) in enumerate(zip(raw["label"], raw["input_ids"]))
    ]
    return Dataset.from_dict(
        {"input_ids": raw["input_ids"], "attention_mask": raw["attention_mask"], "labels": targets}
    )


def seq2seq_trainer(output_dir, model, dp_config: DPConfig, eval_dataset=None, compute_metrics=None, **arg_overrides):
    """privatize(Seq2SeqTrainer) on 32 tiny (source, target) pairs, 8 a chunk, 2 steps; `arg_overrides` for
    Seq2SeqTrainingArguments (generation, checkpointing)."""
    tokenizer = tiny.tokenizer()
    args = dict(
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return privatize(Seq2SeqTrainer)(
        model=model,
        args=Seq2SeqTrainingArguments(str(output_dir), **{**args, **arg_overrides}),
        train_dataset=_seq2seq_pairs(32, 0),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        compute_metrics=compute_metrics,
        dp_config=dp_config,
    )


@pytest.mark.parametrize("factory", [t5, lambda: lora(bart())], ids=["t5", "bart-lora"])
def test_private_seq2seq_trainer_trains_evaluates_by_generation_and_saves(tmp_path, factory):
    model = factory()
    seen = {}

    def generated(prediction):  # predict_with_generate: generated token ids
        seen["shape"] = np.asarray(prediction.predictions).shape
        return {"pairs": float(seen["shape"][0])}

    trainer = seq2seq_trainer(
        tmp_path,
        model,
        DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        eval_dataset=_seq2seq_pairs(8, 1),
        compute_metrics=generated,
        predict_with_generate=True,
        generation_max_length=5,
        per_device_eval_batch_size=8,
    )
    trainer.train()
    assert trainer.ledger.total_steps == 2 and not trainer.privacy_run.needs_independence_probe  # the probe passed
    metrics = trainer.evaluate()
    assert metrics["eval_pairs"] == 8.0 and len(seen["shape"]) == 2  # [pairs, generated tokens]: ids, not logits
    trainer.save_model(str(tmp_path / "final"))
    saved = {p.name for p in (tmp_path / "final").iterdir()}
    assert ("adapter_model.safetensors" in saved) if hasattr(model, "peft_config") else ("model.safetensors" in saved)
    report = trainer.privacy_report()
    assert report["steps"] == 2 and 0 < report["epsilon"] < float("inf")
