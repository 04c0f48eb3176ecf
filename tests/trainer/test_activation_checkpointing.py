"""Activation checkpointing through the trainers: the released update equals the one without it, the sensitivity stays
≤ C, and TRL's SFTConfig / DPOConfig train privately as TRL writes them (checkpointing on by default)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.checkpoint import checkpoint
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
)
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_private import DPConfig, DPFPConfig, PrivateTrainer, privatize
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError
from tests.data import test_packing, test_user_level
from tests.integrations import test_trl_dpo, test_trl_sft
from tests.methods import test_method_conformance as method_rows
from tests.models import test_encoder_decoder
from tests.support import tiny
from tests.support.helpers import make_trainer, run_doc_block, training_args


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
# TRL's configs, whose test arguments (TRL_TEST_ARGS) turn gradient_checkpointing off: turned on under that name
TRL_MODES = {
    "off": {},
    "non-reentrant": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}),
    "reentrant": MODES["reentrant"],
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


@pytest.mark.parametrize("family", ["sft", "dpo"])
def test_trl_trains_privately_with_its_config_at_its_defaults(family, tmp_path):
    if family == "sft":
        args = SFTConfig(str(tmp_path), **TRL_AS_WRITTEN)
        models, data = (tiny.llama(),), tiny.texts()
    else:
        args = DPOConfig(str(tmp_path), **TRL_AS_WRITTEN)
        models, data = (tiny.llama(), tiny.llama()), tiny.preference_pairs()
    assert args.gradient_checkpointing and args.bf16  # TRL's defaults, which private training now keeps
    trainer = privatize(SFTTrainer if family == "sft" else DPOTrainer)(
        *models,
        args,
        train_dataset=data,
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(target_epsilon=8.0, max_grad_norm=1.0),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    report = trainer.privacy_report()
    assert trainer.model.is_activation_checkpointing
    assert report["steps"] == 2 and 0 < report["epsilon"] <= 8.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


# ---------------------------------------------------------------------- every method, packing, users, seq2seq
def _all_parameters(model) -> torch.Tensor:
    """Every parameter, trainable or not: a selecting method (DP-FROST) or a projecting one (RGP) moves tensors that
    are not trainable at the end of the run."""
    return torch.cat([p.detach().flatten().double() for p in model.parameters()])


def _trained_from(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameters before and after `trainer.train()` (a method that wraps the model has wrapped it by then)."""
    before = _all_parameters(trainer.model)
    trainer.train()
    return before, _all_parameters(trainer.model)


def _releases_equally(run, modes=("non-reentrant", "reentrant")) -> None:
    """`run(mode)` builds a trainer with the mode's checkpointing: a checkpointed run must end where the plain one
    does, under the same noise seed."""
    initial, without = _trained_from(run("off"))
    moved = (without - initial).norm()
    assert moved > 0
    for mode in modes:
        trainer = run(mode)
        assert (_trained_from(trainer)[1] - without).norm() <= 1e-5 * moved, mode
        assert getattr(trainer.model, "is_activation_checkpointing", False), mode


# each method in one mode; both modes are covered across them (the row's config and model: the conformance table)
METHOD_MODES = {
    "dp-lora": "reentrant",
    "dp-bitfit": "non-reentrant",
    "dp-frost": "reentrant",
    "dp-fp": "non-reentrant",
    "sparse-lowrank": "non-reentrant",
    "sparse-lowrank/rgp": "reentrant",
}


@pytest.mark.parametrize("row", list(METHOD_MODES))
def test_every_method_releases_with_checkpointing_what_it_releases_without(row, tmp_path):
    config, factory = method_rows.ROWS[row]
    config = dataclasses.replace(config, noise_seed=11)

    def run(mode: str):
        return make_trainer(
            tmp_path / mode,
            model=factory(),
            dataset=tiny.sentiment_dataset(32),
            dp=config,
            max_steps=2,
            per_device_train_batch_size=8,
            **MODES[mode],
        )

    _releases_equally(run, [METHOD_MODES[row]])


# each layout in one mode, both modes covered
PACKED_LAYOUTS = {  # name: (SFTConfig and trainer settings, checkpointing mode)
    "padding-free": (dict(padding_free=True, packed_row_tokens=16), "non-reentrant"),
    "bfd": (dict(padding_free=False, packing=True, max_length=64, packing_strategy="bfd"), "reentrant"),
}


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_packed_sft_releases_with_checkpointing_what_it_releases_without(layout, tmp_path):
    """TRL's padding-free rows (cut into packed rows of 16 tokens) and BFD packing (rows of 64): each packed row's
    examples are split apart in the recompute as in the forward."""
    rows = [{"prompt": p["prompt"], "completion": p["completion"]} for p in tiny.prompt_completions(8)]
    settings, mode = PACKED_LAYOUTS[layout]
    without = test_packing.sft_update(tmp_path / "off", rows=rows, **settings)
    with_checkpointing = test_packing.sft_update(tmp_path / mode, rows=rows, **settings, **TRL_MODES[mode])
    assert without.norm() > 0
    assert (with_checkpointing - without).norm() <= 1e-5 * without.norm()


def test_user_level_units_release_with_checkpointing_what_they_release_without(tmp_path):
    """A user's examples are rows of one unit (clipped together): the recompute records them as the forward does."""
    data, users = test_user_level._user_rows(8, 3)
    dp = DPConfig(
        noise_multiplier=1.0,
        max_grad_norm=0.5,
        noise_seed=11,
        privacy_unit="user",
        user_column="user_id",
        examples_per_user=2,
    )
    _releases_equally(
        lambda mode: test_user_level.user_trainer(
            tmp_path / mode, data, users, dp, per_device_train_batch_size=4, max_steps=2, **MODES[mode]
        )
    )


# T5 in both modes (its relative bias is expanded to the chunk's rows by a forward pre-hook), BART in one
SEQ2SEQ_CASES = [
    pytest.param(test_encoder_decoder.t5, "non-reentrant", id="t5-non-reentrant"),
    pytest.param(test_encoder_decoder.t5, "reentrant", id="t5-reentrant"),
    pytest.param(test_encoder_decoder.bart, "reentrant", id="bart-reentrant"),
]


@pytest.mark.parametrize(("factory", "mode"), SEQ2SEQ_CASES)
def test_seq2seq_pairs_release_with_checkpointing_what_they_release_without(factory, mode, tmp_path):
    """privatize(Seq2SeqTrainer): T5's relative attention bias, expanded to the chunk's rows by a forward pre-hook,
    must be expanded in the recompute as in the forward; BART's learned positions and tied embeddings."""

    def run(mode: str):
        dp_config = DPConfig(noise_multiplier=1.0, max_grad_norm=0.5, noise_seed=11)
        return test_encoder_decoder.seq2seq_trainer(tmp_path / mode, factory(), dp_config, **MODES[mode])

    _releases_equally(run, [mode])


# ---------------------------------------------------------------------- the launch checks under recomputation
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_the_independence_probe_refuses_a_loss_that_mixes_examples_with_checkpointing(mode, tmp_path):
    """TRL's batch normalisation put back (each sequence's loss over the batch's trained tokens): refused on the
    first chunk, before any release, with checkpointing on as without it."""
    with pytest.raises(ValueError, match="its gradient depends on the other examples"):
        test_trl_sft.sensitivity(
            tmp_path,
            test_trl_sft.SHORT,
            test_trl_sft.CLIP,
            test_trl_sft.batch_normalised_loss,
            **TRL_MODES[mode],
        )


class _PartlyHidden(torch.nn.Module):
    """A layer that uses its weight once through its own module and once outside it (invisible to the hooks)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) + x @ self.proj.weight


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_autograd_sum_check_catches_a_hidden_use_inside_a_checkpointed_segment(reentrant):
    layer = _PartlyHidden()
    engine = PerExampleGradientEngine(layer, 1.0)
    engine.attach()
    x = torch.randn(3, 4, requires_grad=reentrant)  # a reentrant segment needs an input that requires grad
    with engine.recording(3):
        checkpoint(layer, x, use_reentrant=reentrant).pow(2).sum().backward()
    with pytest.raises(UnsupportedLayerError, match="proj.weight.*used outside its module"):
        engine.finish_backward()


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_a_dpfp_noise_point_inside_a_checkpointed_layer_is_refused_before_any_release(mode, tmp_path):
    """Its recompute in backward would draw the representation's noise again: refused on the first chunk."""
    config = DPFPConfig(noise_multiplier=0.8, max_grad_norm=0.5, noise_point="bert.encoder.layer.1.attention.output")
    trainer = make_trainer(tmp_path, model=tiny.bert(), dp=config, max_steps=1, **MODES[mode])
    with pytest.raises(RuntimeError, match="noise point .BertSelfOutput. lies inside an activation-checkpointed"):
        trainer.train()
    assert trainer.ledger.total_steps == 0


def test_docs_long_context_block_runs_as_written(tmp_path, monkeypatch):
    namespace = run_doc_block("guides/long-context.md", tmp_path, monkeypatch)
    trainer = namespace["trainer"]
    assert trainer.model.is_activation_checkpointing
    report = trainer.privacy_report()
    assert report["steps"] == report["planned_steps"] > 0 and 0 < report["epsilon"] <= 8.0
