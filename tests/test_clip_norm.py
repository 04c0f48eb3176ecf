"""C from the model on public inputs: each example's gradient norm over what the method trains, model untouched."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithPadding, TrainerCallback

from hf_private import BitFitConfig, DPConfig, DPLoRAConfig, median_gradient_norm, public_calibration_texts
from hf_private.clip_norm import gradient_norms_at_init
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot


def _examples(n: int = 6) -> list[dict]:
    tok = tiny.tokenizer()
    encoded = tok(public_calibration_texts(n), truncation=True)
    return [
        {"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i], "labels": i % 2}
        for i in range(n)
    ]


def _reference_norms(model, trains, examples) -> torch.Tensor:
    """One example at a time through plain autograd, over the parameters `trains(name)` selects."""
    model.eval()
    params = [p for name, p in model.named_parameters() if trains(name)]
    norms = []
    for example in examples:
        logits = model(
            input_ids=torch.tensor([example["input_ids"]]), attention_mask=torch.tensor([example["attention_mask"]])
        ).logits
        loss = F.cross_entropy(logits, torch.tensor([example["labels"]]))
        grads = torch.autograd.grad(loss, params)
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    return torch.stack(norms)


@pytest.mark.parametrize(
    "config, trains",
    [
        (DPConfig(noise_multiplier=1.0), lambda name: True),
        (BitFitConfig(noise_multiplier=1.0), lambda name: name.endswith("bias") or name.startswith("classifier")),
    ],
)
def test_norms_are_each_examples_gradient_over_what_the_method_trains(config, trains):
    model, examples = tiny.bert(), _examples()
    before = snapshot(model)
    grads_enabled = {n: p.requires_grad for n, p in model.named_parameters()}
    norms = gradient_norms_at_init(model, config, examples, DataCollatorWithPadding(tiny.tokenizer()))
    assert all(torch.equal(before[k], v) for k, v in snapshot(model).items())
    assert grads_enabled == {n: p.requires_grad for n, p in model.named_parameters()}
    torch.testing.assert_close(norms, _reference_norms(model, trains, examples), rtol=1e-4, atol=1e-7)
    assert norms.min() > 0 and len(set(norms.tolist())) == len(examples)


def test_dp_lora_is_measured_on_a_wrapped_copy():
    model, examples = tiny.bert(), _examples(4)
    collate = DataCollatorWithPadding(tiny.tokenizer())
    c_lora = median_gradient_norm(model, DPLoRAConfig(noise_multiplier=1.0, lora_r=2), examples, collate)
    c_full = median_gradient_norm(model, DPConfig(noise_multiplier=1.0), examples, collate)
    assert not hasattr(model, "peft_config") and 0 < c_lora < c_full


def test_nothing_to_measure_is_refused():
    collate = DataCollatorWithPadding(tiny.tokenizer())
    with pytest.raises(ValueError, match="No examples"):
        median_gradient_norm(tiny.bert(), DPConfig(noise_multiplier=1.0), [], collate)
    unlabelled = [{k: v for k, v in e.items() if k != "labels"} for e in _examples(2)]
    with pytest.raises(ValueError, match="'labels'"):
        median_gradient_norm(tiny.bert(), DPConfig(noise_multiplier=1.0), unlabelled, collate)


# ---------------------------------------------------------------------- C far above the norms, caught in training
FAR_ABOVE = "is far above the per-example gradient norms"


class _FirstBatchNorms(TrainerCallback):
    """The norms the training engine clipped in the first logical batch (an engine norm hook, read at step 1)."""

    def __init__(self, trainer) -> None:
        self.seen: list[torch.Tensor] = []
        self.first: torch.Tensor | None = None
        trainer.engine.add_norm_hook(self.seen.append)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.first = torch.cat(self.seen)


def _train_and_warnings(tmp_path, caplog, clip: float) -> tuple[list[str], torch.Tensor]:
    trainer = make_trainer(
        tmp_path, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=clip), max_steps=4, per_device_train_batch_size=16
    )
    norms = _FirstBatchNorms(trainer)
    trainer.add_callback(norms)
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer.train()
    return [r.getMessage() for r in caplog.records if FAR_ABOVE in r.getMessage()], norms.first


def test_a_clip_norm_far_above_the_norms_warns_once_after_the_first_batch_naming_the_median(tmp_path, caplog):
    """Issue 45: max_grad_norm=1e4 trained to the end, learnt nothing, and said nothing."""
    warnings, first = _train_and_warnings(tmp_path, caplog, clip=1e4)
    assert len(warnings) == 1 and first.numel() > 0 and first.max() < 1e4
    message = warnings[0]
    assert f"C=1e+04 {FAR_ABOVE}: in the first logical batch 0 of {first.numel()} examples were clipped" in message
    assert f"their median norm was {float(first.median()):.2g}" in message and "σ·C=1e+04" in message
    assert "hf_private.median_gradient_norm" in message and "not covered by ε" in message


def test_a_sensible_clip_norm_does_not_warn(tmp_path, caplog):
    collate = DataCollatorWithPadding(tiny.tokenizer())
    clip = median_gradient_norm(tiny.bert(), DPConfig(noise_multiplier=1.0), _examples(32), collate)
    warnings, first = _train_and_warnings(tmp_path, caplog, clip=clip)
    assert not warnings and first.numel() > 0
