"""Activation checkpointing through the trainers: the released update equals the one without it, the sensitivity stays
≤ C, and TRL's SFTConfig / DPOConfig train privately as TRL writes them (checkpointing on by default)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_private import DPConfig, PrivateTrainer, privatize
from tests.integrations import test_trl_dpo, test_trl_sft
from tests.support import tiny
from tests.support.helpers import training_args


def _llama_lora():
    torch.manual_seed(2)
    return get_peft_model(tiny.llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM"))


MODELS = {  # name: (model factory, dataset, collator)
    "bert": (tiny.bert, lambda: tiny.sentiment_dataset(32), lambda tok: DataCollatorWithPadding(tok)),
    "gpt2-tied": (tiny.gpt2, lambda: tiny.lm_dataset(32), lambda tok: DataCollatorForLanguageModeling(tok, mlm=False)),
    "llama": (tiny.llama, lambda: tiny.lm_dataset(32), lambda tok: DataCollatorForLanguageModeling(tok, mlm=False)),
    "llama-lora": (
        _llama_lora,
        lambda: tiny.lm_dataset(32),
        lambda tok: DataCollatorForLanguageModeling(tok, mlm=False),
    ),
}
# non-reentrant (transformers' default now) and reentrant (its former default), under both names of the argument
MODES = {
    "off": {},
    "non-reentrant": dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False}),
    "reentrant": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
}


def _trained(tmp_path, name: str, mode: str) -> torch.Tensor:
    factory, dataset, collator = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model,
        training_args(tmp_path / mode, max_steps=2, per_device_train_batch_size=8, **MODES[mode]),
        train_dataset=dataset(),
        data_collator=collator(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=0.5, noise_seed=11),
    )
    trainer.train()
    assert getattr(trainer.model, "is_activation_checkpointing", False) is (mode != "off")
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_released_update_with_checkpointing_equals_the_one_without(name, mode, tmp_path):
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in MODELS[name][0]().parameters() if p.requires_grad])
    without = _trained(tmp_path, name, "off")
    with_checkpointing = _trained(tmp_path, name, mode)
    assert (without - initial).norm() > 0
    assert (with_checkpointing - without).norm() <= 1e-5 * (without - initial).norm()


def test_dpo_pairs_with_checkpointing_release_what_they_release_without(tmp_path):
    released = {
        on: test_trl_dpo.released_sum(
            tmp_path / str(on), [*test_trl_dpo.SHORT, test_trl_dpo.ADDED], 0.5, gradient_checkpointing=on
        )
        for on in (True, False)
    }
    assert released[False].norm() > 0
    assert (released[True] - released[False]).norm() <= 1e-5 * released[False].norm()


def test_adding_one_example_moves_the_released_sum_by_at_most_C_with_checkpointing(tmp_path):
    clip = test_trl_sft.CLIP
    moved = test_trl_sft.sensitivity(
        tmp_path, test_trl_sft.SHORT + test_trl_sft.LONG, clip, gradient_checkpointing=True
    )
    assert 0.5 * clip < moved <= clip * (1 + 1e-4)


def test_adding_one_pair_moves_the_released_sum_by_at_most_C_with_checkpointing(tmp_path):
    clip = test_trl_dpo.CLIP
    moved = test_trl_dpo.sensitivity(tmp_path, test_trl_dpo.LONG, clip, gradient_checkpointing=True)
    assert 0.5 * clip < moved <= clip * (1 + 1e-4)


# TRL's configs as TRL's docs write them; on a machine without a GPU transformers wants use_cpu=True for their bf16
TRL_AS_WRITTEN = dict(use_cpu=True, max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True)


def test_sft_trains_privately_with_sftconfig_at_its_defaults(tmp_path):
    args = SFTConfig(str(tmp_path), **TRL_AS_WRITTEN)
    assert args.gradient_checkpointing and args.bf16  # TRL's defaults, which private training now keeps
    trainer = privatize(SFTTrainer)(
        tiny.llama(),
        args,
        train_dataset=tiny.texts(),
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(target_epsilon=8.0, max_grad_norm=1.0),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    report = trainer.privacy_report()
    assert trainer.model.is_activation_checkpointing
    assert report["steps"] == 2 and 0 < report["epsilon"] <= 8.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_dpo_trains_privately_with_dpoconfig_at_its_defaults(tmp_path):
    args = DPOConfig(str(tmp_path), **TRL_AS_WRITTEN)
    assert args.gradient_checkpointing and args.bf16
    trainer = privatize(DPOTrainer)(
        tiny.llama(),
        tiny.llama(),
        args,
        train_dataset=tiny.preference_pairs(),
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(target_epsilon=8.0, max_grad_norm=1.0),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    report = trainer.privacy_report()
    assert trainer.model.is_activation_checkpointing
    assert report["steps"] == 2 and 0 < report["epsilon"] <= 8.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
