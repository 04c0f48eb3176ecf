"""End-to-end behaviour of PrivateTrainer: training, ε logging, the card, budgets, resume and bad input."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml
from datasets import Dataset
from huggingface_hub import ModelCard
from peft import LoraConfig, get_peft_model
from torch.utils.data import IterableDataset
from transformers import DataCollatorForLanguageModeling, TrainerCallback

from hf_private import BudgetError, DPConfig, PrivateTrainer, UnsupportedLayerError
from hf_private.artifacts import LEDGER_NAME
from hf_private.privacy import MechanismGroup, compute_epsilon
from tests import tiny
from tests.helpers import make_trainer, snapshot, training_args


def _logged(trainer, key):
    return [entry for entry in trainer.state.log_history if key in entry]


def test_trains_logs_epsilon_every_step_and_writes_card(tmp_path):
    dev = tiny.sentiment_dataset(64, seed=9)
    # A deterministic test seed: the utility check must not depend on a secret draw (privacy is tested elsewhere).
    dp = DPConfig(target_epsilon=30.0, noise_seed=0)
    # lr 2e-2: at 5e-3 the held-out loss fell for only 2 of 4 noise seeds (40 steps at ε = 30).
    trainer = make_trainer(tmp_path, dataset=tiny.sentiment_dataset(800), dp=dp, num_train_epochs=5,
                           learning_rate=2e-2, per_device_train_batch_size=100)
    trainer.eval_dataset = dev
    start = trainer.evaluate()["eval_loss"]
    trainer.train()
    end = trainer.evaluate()["eval_loss"]
    assert end < start, f"held-out loss did not fall ({start:.3f} → {end:.3f})"

    steps = _logged(trainer, "loss")
    assert len(steps) == trainer.state.global_step
    epsilons = [entry["epsilon"] for entry in steps]
    # Per-step logs never decrease and track progress (tests/test_epsilon_log.py: they bound the ε spent).
    assert all(a <= b for a, b in zip(epsilons, epsilons[1:])) and epsilons[0] < epsilons[-1]
    assert not _logged(trainer, "grad_norm"), "the non-private gradient norm must not be logged"
    report = trainer.privacy_report()
    assert 29.0 < report["epsilon"] <= 30.0
    assert report["guarantee"] == "none", "a run with a test seed must not claim a formal guarantee"
    assert report["steps"] == trainer.planned_steps
    assert _logged(trainer, "train_loss")[-1]["epsilon"] == report["epsilon"]  # the final line is exact

    trainer.save_model()
    card = ModelCard.load(os.path.join(tmp_path, "README.md"))
    privacy = card.data.to_dict()["privacy"]
    assert privacy["unit"] == "example" and privacy["method"] == "dp-sgd"
    assert privacy["dataset_size"] == 800 and privacy["accountant"] == "prv"
    recomputed = compute_epsilon([MechanismGroup.from_dict(m) for m in privacy["mechanisms"]], privacy["delta"], "prv")
    assert recomputed == pytest.approx(privacy["epsilon"], rel=1e-9)
    assert "## Privacy" in card.text and "not covered" in card.text
    assert "Training Loss" not in card.content and "train_loss" not in card.content  # Trainer's results table
    assert not re.search(r"(?<!max_)grad_norm", card.content)
    last_loss = f"{steps[-1]['loss']:.4g}"
    assert last_loss not in card.content
    assert os.path.isfile(os.path.join(tmp_path, LEDGER_NAME))
    assert DPConfig.from_pretrained(tmp_path) == trainer.dp_config


def test_lora_adapter_is_saved_with_privacy_card(tmp_path):
    model = get_peft_model(tiny.roberta(), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))
    trainer = make_trainer(tmp_path, model=model, max_steps=3)
    trainer.train()
    trainer.save_model()
    assert os.path.isfile(os.path.join(tmp_path, "adapter_model.safetensors"))
    card = ModelCard.load(os.path.join(tmp_path, "README.md"))
    privacy = card.data.to_dict()["privacy"]
    assert card.data.library_name == "peft" and privacy["guarantee"] == "formal" and privacy["epsilon"] > 0


@pytest.mark.parametrize("factory", [tiny.gpt2, tiny.llama])
def test_causal_lm_trains(tmp_path, factory):
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=factory(), args=training_args(tmp_path, max_steps=2), train_dataset=tiny.lm_dataset(64),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False), dp_config=DPConfig(noise_multiplier=1.0),
    )
    trainer.train()
    assert trainer.ledger.total_steps == 2


def test_gradient_accumulation_chunks_one_logical_batch(tmp_path):
    trainer = make_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=2)
    loader = trainer.get_train_dataloader()
    assert len(loader) == trainer.steps_per_epoch * 3
    assert trainer.sample_rate == pytest.approx(12 / 96)
    trainer.train()
    assert trainer.ledger.total_steps == 2 and trainer.state.global_step == 2


# ---------------------------------------------------------------- budget
def test_training_stops_before_the_budget_is_exceeded(tmp_path, caplog):
    trainer = make_trainer(tmp_path, dp=DPConfig(target_epsilon=2.0), max_steps=4)
    trainer.args.max_steps = 40  # asks for ten times the calibrated plan
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.ledger.epsilon() <= 2.0
    assert 4 <= trainer.ledger.total_steps < 40
    assert trainer.state.global_step == trainer.ledger.total_steps  # no empty step after the stop
    assert caplog.text.count("Privacy budget reached") == 1


class _Kill(TrainerCallback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            raise KeyboardInterrupt("simulated kill")


def test_kill_and_resume_continues_the_ledger(tmp_path):
    dp = DPConfig(target_epsilon=4.0)
    full = make_trainer(tmp_path / "full", dp=dp, max_steps=8)
    full.train()

    interrupted = make_trainer(tmp_path / "run", dp=dp, max_steps=8, save_strategy="steps", save_steps=4)
    interrupted.add_callback(_Kill(at_step=6))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    with open(tmp_path / "run" / "checkpoint-4" / LEDGER_NAME) as f:
        assert sum(m["steps"] for m in json.load(f)["mechanisms"]) == 4

    resumed = make_trainer(tmp_path / "run", dp=dp, max_steps=8, save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.total_steps == 8
    assert resumed.ledger.epsilon() == pytest.approx(full.ledger.epsilon(), rel=1e-12)


def test_resume_from_checkpoint_without_ledger_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    os.remove(tmp_path / "checkpoint-2" / LEDGER_NAME)
    again = make_trainer(tmp_path, max_steps=4)
    with pytest.raises(FileNotFoundError, match="lose the privacy already spent"):
        again.train(resume_from_checkpoint=True)


# ---------------------------------------------------------------- bad input, all before training
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_epsilon=0.0), "target_epsilon must be > 0"),
        (dict(target_epsilon=-1.0), "target_epsilon must be > 0"),
        (dict(target_epsilon=1.0, noise_multiplier=1.0), "exactly one"),
        (dict(), "exactly one"),
        (dict(noise_multiplier=1.0, max_grad_norm=0.0), "max_grad_norm"),
        (dict(noise_multiplier=1.0, max_grad_norm=-1.0), "max_grad_norm"),
        (dict(noise_multiplier=1.0, accountant="gdp"), "accountant"),
    ],
)
def test_invalid_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPConfig(**kwargs)


def test_delta_at_least_one_over_n_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not below 1/N"):
        make_trainer(tmp_path, dp=DPConfig(target_epsilon=1.0, target_delta=1 / 96))


def test_default_delta_is_below_one_over_n(tmp_path):
    trainer = make_trainer(tmp_path, dp=DPConfig(target_epsilon=1.0))
    assert trainer.delta == pytest.approx(1 / (2 * 96))


def test_no_trainable_parameters_is_refused(tmp_path):
    model = tiny.bert().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_trainer(tmp_path, model=model)


def test_batchnorm_is_refused(tmp_path):
    model = tiny.bert()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    with pytest.raises(ValueError, match="BatchNorm"):
        make_trainer(tmp_path, model=model)


def test_unsupported_trainable_layer_is_refused(tmp_path):
    model = tiny.bert()
    model.classifier = torch.nn.Sequential(torch.nn.Unflatten(1, (1, 32)), torch.nn.Conv1d(1, 2, 32),
                                           torch.nn.Flatten())
    with pytest.raises(UnsupportedLayerError, match="Conv1d"):
        make_trainer(tmp_path, model=model)


class _Stream(IterableDataset):
    def __iter__(self):
        yield from tiny.sentiment_dataset(8)


def test_iterable_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="IterableDataset"):
        make_trainer(tmp_path, dataset=_Stream())


def test_empty_dataset_is_refused(tmp_path):
    empty = Dataset.from_dict({"input_ids": [], "attention_mask": [], "label": []})
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, dataset=empty)


def test_unreachable_target_is_refused_before_training(tmp_path):
    with pytest.raises(BudgetError):
        make_trainer(tmp_path, dp=DPConfig(target_epsilon=1e-4), per_device_train_batch_size=90, num_train_epochs=50)


def test_card_yaml_has_no_training_loss(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    trainer.save_model()
    header = open(tmp_path / "README.md").read().split("---")[1]
    metadata = yaml.safe_load(header)
    assert "loss" not in json.dumps(metadata).lower()


def test_insecure_test_mode_is_not_called_a_guarantee(tmp_path):
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, noise_seed=7), max_steps=1)
    trainer.train()
    trainer.save_model()
    privacy = ModelCard.load(os.path.join(tmp_path, "README.md")).data.to_dict()["privacy"]
    assert privacy["guarantee"] == "none" and "noise_seed" in privacy["guarantee_note"]


def test_model_stays_the_users_model(tmp_path):
    model = tiny.bert()
    trainer = make_trainer(tmp_path, model=model, max_steps=1)
    trainer.train()
    assert trainer.model is model
    trainer.save_model()
    reloaded = type(model).from_pretrained(tmp_path)
    assert torch.equal(reloaded.classifier.weight, model.classifier.weight)


def test_bf16_trains_under_autocast_and_fp16_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, bf16=True, max_steps=2)
    model = trainer.model
    dtypes = set()
    layer = model.bert.encoder.layer[0].attention.self.query
    handle = layer.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype) if module.training else None)
    before = snapshot(model)
    trainer.train()
    handle.remove()
    assert dtypes == {torch.bfloat16}, "training forward did not run under bf16 autocast"
    assert trainer.ledger.total_steps == 2
    assert all(not torch.equal(before[f"param:{n}"], p) for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="fp16 with a GradScaler.*bf16=True"):
        make_trainer(tmp_path, fp16=True)
