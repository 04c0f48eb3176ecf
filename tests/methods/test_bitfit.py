"""DP-BiTFiT: parameter selection, the activation-free path, two-phase X+BiTFiT in one ledger, the card."""

from __future__ import annotations

import os

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import TrainerCallback

from hf_private import BitFitConfig
from hf_private.engine import PerExampleGradientEngine, core
from hf_private.privacy import MechanismGroup, compute_epsilon
from tests.support import tiny
from tests.support.helpers import make_trainer


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_selects_every_bias_and_the_new_head():
    model = tiny.roberta()
    BitFitConfig(target_epsilon=1.0).build_method().prepare_model(model)
    names = _trainable(model)
    assert {n for n, _ in model.named_parameters() if n.endswith(".bias")} <= names
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= names
    assert all(n.endswith(".bias") or n.startswith("classifier.") for n in names)
    assert any("LayerNorm.bias" in n for n in names) and any("attention.self.query.bias" in n for n in names)


def test_paper_mode_freezes_the_head_weights_and_norm_option_adds_gains():
    model = tiny.roberta()
    BitFitConfig(target_epsilon=1.0, train_head=False).build_method().prepare_model(model)
    assert all(n.endswith(".bias") for n in _trainable(model))
    BitFitConfig(target_epsilon=1.0, train_norm_weights=True).build_method().prepare_model(model)
    assert any(n.endswith("LayerNorm.weight") for n in _trainable(model))


def test_gpt2_conv1d_biases_and_no_head_for_a_language_model():
    model = tiny.gpt2()
    BitFitConfig(target_epsilon=1.0).build_method().prepare_model(model)
    names = _trainable(model)
    assert "transformer.h.0.attn.c_attn.bias" in names and "transformer.h.0.ln_1.bias" in names
    assert all(n.endswith(".bias") for n in names), "the tied LM head is not a new head"


def test_model_without_biases_gets_a_clear_error():
    with pytest.raises(ValueError, match="no bias parameters.*LoRA"):
        BitFitConfig(target_epsilon=1.0).build_method().prepare_model(tiny.llama())


def test_no_activation_is_held_for_bias_only_layers(monkeypatch):
    """Only layers with a trainable weight (the head) keep their input; every other call keeps nothing."""
    calls = []

    class RecordedCall(core._Call):  # every call the forward hooks make, as they make it
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            calls.append(self)

    monkeypatch.setattr(core, "_Call", RecordedCall)
    model = tiny.roberta().train()
    BitFitConfig(target_epsilon=1.0).build_method().prepare_model(model)
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    batch = tiny.sentiment_dataset(4)[:4]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in batch["input_ids"]], batch_first=True)
    with engine.recording(4):
        logits = model(input_ids=ids).logits
        held = {call.layer.name for call in calls if call.saved is not None}
        logits.sum().backward()
    assert held == {"classifier.dense (Linear)", "classifier.out_proj (Linear)"}
    assert len(calls) == len(engine._calls) == len(engine.layers) == 19  # every bias layer ran its hook, kept nothing
    engine.finish_backward()
    assert engine._calls == []


def test_two_phase_training_is_one_ledger_with_one_group_per_phase(tmp_path):
    model = tiny.roberta()
    weight = "roberta.encoder.layer.0.attention.self.query.weight"
    dp = BitFitConfig(target_epsilon=4.0, full_finetune_epochs=1)
    trainer = make_trainer(tmp_path, model=model, dp=dp, num_train_epochs=2, per_device_train_batch_size=16)
    assert weight in _trainable(model), "phase 1 is full fine-tuning"
    trainer.train()
    assert weight not in _trainable(model) and "roberta.encoder.layer.0.attention.self.query.bias" in _trainable(model)
    groups = trainer.ledger.mechanisms
    assert [g.name for g in groups] == ["dp-sgd", "dp-bitfit"]
    assert groups[0].steps == trainer.steps_per_epoch and sum(g.steps for g in groups) == trainer.planned_steps
    assert trainer.ledger.epsilon() <= 4.0

    trainer.save_model()
    privacy = ModelCard.load(os.path.join(tmp_path, "README.md")).data.to_dict()["privacy"]
    assert privacy["method"] == "dp-bitfit" and [m["name"] for m in privacy["mechanisms"]] == ["dp-sgd", "dp-bitfit"]
    assert [p["mechanism"] for p in privacy["phases"]] == ["dp-sgd", "dp-bitfit"]
    mechanisms = [MechanismGroup.from_dict(m) for m in privacy["mechanisms"]]
    assert compute_epsilon(mechanisms, privacy["delta"], privacy["accountant"]) == pytest.approx(privacy["epsilon"])


def test_phase_two_weights_stay_frozen(tmp_path):
    model = tiny.roberta()
    dp = BitFitConfig(noise_multiplier=1.0, full_finetune_epochs=1)
    trainer = make_trainer(tmp_path, model=model, dp=dp, num_train_epochs=2, per_device_train_batch_size=16)
    weight = model.roberta.encoder.layer[0].attention.self.query.weight
    snapshots = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(weight.detach().clone())

    trainer.add_callback(Record())
    trainer.train()
    switch = trainer.steps_per_epoch
    assert not torch.equal(snapshots[0], snapshots[switch - 1]), "phase 1 must train the weights"
    assert all(torch.equal(snapshots[switch - 1], s) for s in snapshots[switch:]), "phase 2 trains biases only"


def test_bitfit_card_reports_method_and_trainable_fraction(tmp_path):
    trainer = make_trainer(tmp_path, model=tiny.roberta(), dp=BitFitConfig(target_epsilon=3.0), max_steps=2)
    trainer.train()
    trainer.save_model()
    card = ModelCard.load(os.path.join(tmp_path, "README.md"))
    privacy = card.data.to_dict()["privacy"]
    assert privacy["method"] == "dp-bitfit" and 0 < privacy["trainable_fraction"] < 0.2
    assert "Bias-Term Fine-tuning" in card.text
