"""DP-FROST through the trainer: config, partitions, the jointly calibrated plan, the selection's releases in the
ledger, training only the selection, resume without re-selecting, K selections, causal LMs.

PSEL/PGM-EST arithmetic: test_frost_selection.py; the magnitudes and their Lemma 3 sensitivity: test_frost_pgm.py;
the shared privacy contracts (one extra example, noise, frozen tensors, card ε, adapter reload, one-step audit):
test_method_conformance.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import DataCollatorForLanguageModeling

from hf_private import FrostConfig, PrivateTrainer
from hf_private.methods import MethodConfig
from hf_private.methods.frost.method import SELECTION_STAGE
from hf_private.methods.frost.partitions import model_partitions
from hf_private.privacy import MechanismGroup
from hf_private.privacy.accountants import compute_epsilon
from hf_private.privacy.calibration import calibrate_noise_multiplier
from hf_private.release.adapters import private_adapter_names
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot, training_args

N = 200
FROST = FrostConfig(
    noise_multiplier=0.8, max_grad_norm=1.0, unfreeze_ratio=0.3, selection_sample_rate=0.25, noise_seed=11
)


def _trainer(tmp_path, dp=FROST, model=None, n=N, **overrides):
    return make_trainer(
        tmp_path,
        model=model if model is not None else tiny.bert(),
        dp=dp,
        dataset=tiny.sentiment_dataset(n),
        **overrides,
    )


def _releases(ledger) -> dict[str, int]:
    """Releases per mechanism (the ledger keeps events in order: a re-selection starts a new group)."""
    totals: dict[str, int] = {}
    for group in ledger.mechanisms:
        totals[group.name] = totals.get(group.name, 0) + group.steps
    return totals


def _changed(before, model) -> set[str]:
    after = snapshot(model)
    return {k.removeprefix("param:") for k, v in before.items() if not torch.equal(v, after[k])}


# ---------------------------------------------------------------------- config and partitions
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("unfreeze_ratio", 0.0, "unfreeze_ratio"),
        ("variant", "mgx", "variant"),
        ("norm_order", 3, "norm_order"),
        ("selection_rounds", 0, "selection_rounds"),
        ("selection_sample_rate", 1.5, "selection_sample_rate"),
        ("gap_coefficient", -1.0, "gap_coefficient"),
        ("sgd_budget_ratio", 1.0, "sgd_budget_ratio"),
        ("num_selections", 0, "num_selections"),
        ("mle_iterations", 2.5, "mle_iterations"),
    ],
)
def test_config_refuses_bad_knobs_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(FROST, **{field: value})


def test_config_round_trips_through_dp_config_json(tmp_path):
    config = dataclasses.replace(FROST, variant="mg", norm_order=2, num_selections=2, skip_oversized=True)
    config.save_pretrained(tmp_path)
    assert MethodConfig.from_pretrained(tmp_path) == config
    assert all(f.metadata.get("help") for f in FrostConfig.own_fields())


@pytest.mark.parametrize("factory", [tiny.bert, tiny.roberta, tiny.gpt2, tiny.llama])
def test_partitions_hold_every_parameter_once_with_its_module(factory):
    model = factory()
    partitions = model_partitions(model)
    names = [n for p in partitions for n in p.parameter_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once, tied tensors included
    params = dict(model.named_parameters())
    assert all(p.size == sum(params[n].numel() for n in p.parameter_names) for p in partitions)
    assert all({n.rsplit(".", 1)[0] for n in p.parameter_names} == {p.name} for p in partitions)
    linear = next(p for p in partitions if p.name.endswith(("attention.self.query", "attn.c_attn", "self_attn.q_proj")))
    assert len(linear.parameter_names) == (1 if factory is tiny.llama else 2)  # weight with its bias
    if factory is tiny.gpt2:  # lm_head is tied to wte: one partition, named after the first module holding it
        assert not any(p.name == "lm_head" for p in partitions)


def test_peft_models_are_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny.bert(), LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match="plain transformers model"):
        _trainer(tmp_path, model=model)


# ---------------------------------------------------------------------- plan
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_plan_is_compute_sigma_with_the_selection_rounds(tmp_path, accountant):
    dp = FrostConfig(target_epsilon=2.0, accountant=accountant, selection_rounds=4, num_selections=2)
    trainer = _trainer(tmp_path, dp=dp, per_device_train_batch_size=8, num_train_epochs=2)
    plan, q, steps = trainer.plan, 8 / N, trainer.planned_steps
    sigma_sgd = calibrate_noise_multiplier(0.9 * 2.0, plan.delta, q, steps, accountant=accountant)
    sigma_ps = calibrate_noise_multiplier(
        2.0, plan.delta, 0.02, 8, accountant=accountant, prior=[MechanismGroup("dp-frost", sigma_sgd, q, steps)]
    )
    assert plan["dp-frost"].noise_multiplier == sigma_sgd
    assert (plan[SELECTION_STAGE].noise_multiplier, plan[SELECTION_STAGE].steps) == (sigma_ps, 8)  # K·T
    assert plan.epsilon() <= 2.0


# ---------------------------------------------------------------------- a run
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("frost")
    # a secure run (no noise_seed): its card carries the ε the tests recompute
    trainer = _trainer(out, dp=dataclasses.replace(FROST, noise_seed=None), per_device_train_batch_size=16, max_steps=4)
    before = snapshot(trainer.model)
    trainer.train()
    trainer.save_model()
    return trainer, before, out


def test_selection_rounds_and_dp_sgd_steps_are_both_in_the_ledger(trained):
    trainer, _, _ = trained
    groups = {g.name: g for g in trainer.ledger.mechanisms}
    assert set(groups) == {SELECTION_STAGE, "dp-frost"}
    selection, sgd = groups[SELECTION_STAGE], groups["dp-frost"]
    assert (selection.steps, selection.sample_rate, selection.noise_multiplier) == (5, 0.25, 0.8)
    assert (sgd.steps, sgd.sample_rate, sgd.noise_multiplier) == (4, 16 / N, 0.8)
    assert trainer.training_steps() == 4 == trainer.state.global_step
    assert trainer.privacy_report()["steps"] == 4


def test_only_the_selection_and_the_head_change(trained):
    trainer, before, _ = trained
    details = trainer.privacy_report()["method_details"]
    selected = details["selected_partitions"]
    assert selected and len(details["selections"]) == 1 and len(details["selections"][0]["rounds"]) == 5
    partitions = {p.name: p for p in model_partitions(trainer.model)}
    expected = {"classifier.weight", "classifier.bias"} | {n for s in selected for n in partitions[s].parameter_names}
    assert trainer.trained_parameter_names == expected
    assert _changed(before, trainer.model) == expected  # everything else bit-identical
    total = sum(p.size for p in partitions.values())
    assert details["selected_fraction"] == pytest.approx(sum(partitions[s].size for s in selected) / total, abs=1e-6)
    assert sum(partitions[s].size for s in selected) <= 0.3 * total  # γ|Θ|


def test_card_lists_the_selection_and_both_mechanisms_and_epsilon_recomputes(trained):
    trainer, _, out = trained
    card = ModelCard.load(out / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert privacy["method"] == "dp-frost"
    assert {m["name"] for m in privacy["mechanisms"]} == {SELECTION_STAGE, "dp-frost"}
    groups = [MechanismGroup.from_dict(m) for m in privacy["mechanisms"]]
    assert compute_epsilon(groups, privacy["delta"], privacy["accountant"]) == pytest.approx(
        privacy["epsilon"], rel=1e-9
    )
    assert (
        privacy["method_details"]["selected_partitions"]
        == trainer.privacy_report()["method_details"]["selected_partitions"]
    )
    for name in privacy["method_details"]["selected_partitions"]:
        assert f"`{name}`" in card.text
    assert "trainable parameters" in card.text and "DP-MGNA" in card.text


def test_a_release_is_noised_with_the_stage_sigma_times_the_sensitivity_and_recorded(tmp_path):
    trainer = _trainer(tmp_path)
    run, sensitivity, size = trainer.privacy_run.method_view, 0.003, 40_000
    released = run.release(SELECTION_STAGE, torch.zeros(size), sensitivity)
    std = 0.8 * sensitivity
    # chi-square: the sample variance of 40k N(0, std²) values is within ±5·sqrt(2/40k) of std² (about 1e-6 failure)
    assert abs(released.double().var().item() / std**2 - 1) < 5 * math.sqrt(2 / size)
    assert run.releases(SELECTION_STAGE) == 1
    with pytest.raises(ValueError, match="sensitivity"):
        run.release(SELECTION_STAGE, torch.zeros(3), 0.0)


def test_selection_samples_are_poisson_at_q_ps(tmp_path):
    trainer = _trainer(tmp_path, per_device_train_batch_size=7)
    sizes = [
        sum(len(c["input_ids"]) for c in trainer.privacy_run.method_view.poisson_sample(SELECTION_STAGE))
        for _ in range(200)
    ]
    mean, expected = sum(sizes) / len(sizes), 0.25 * N
    assert abs(mean - expected) < 4 * math.sqrt(N * 0.25 * 0.75 / len(sizes))
    assert len(set(sizes)) > 5  # sizes vary: not a fixed-size batch


# ---------------------------------------------------------------------- resume, K selections, causal LMs
def test_resume_keeps_the_selection_and_does_not_spend_it_again(tmp_path):
    first = _trainer(tmp_path, per_device_train_batch_size=16, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    selected = first.privacy_report()["method_details"]["selected_partitions"]
    checkpoint = tmp_path / "checkpoint-2"
    second = _trainer(tmp_path, per_device_train_batch_size=16, max_steps=4)
    second.train(resume_from_checkpoint=str(checkpoint))
    assert _releases(second.ledger) == {SELECTION_STAGE: 5, "dp-frost": 4}  # the 5 rounds once, 2 + 2 steps
    assert second.privacy_report()["method_details"]["selected_partitions"] == selected
    assert {n for n, p in second.model.named_parameters() if p.requires_grad} == first.trained_parameter_names


def test_a_state_that_does_not_match_the_ledger_is_refused(tmp_path):
    trainer = _trainer(tmp_path, per_device_train_batch_size=16, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    state = tmp_path / "checkpoint-2" / "dp_method_state.json"
    state.unlink()  # the ledger says 5 rounds were spent, the state knows of none
    resumed = _trainer(tmp_path, per_device_train_batch_size=16, max_steps=4)
    with pytest.raises(RuntimeError, match="do not belong together"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_k_selections_run_at_the_papers_update_indices(tmp_path):
    dp = dataclasses.replace(FROST, num_selections=2, selection_rounds=2)
    trainer = _trainer(tmp_path, dp=dp, per_device_train_batch_size=16, max_steps=5)
    trainer.train()
    selections = trainer.privacy_report()["method_details"]["selections"]
    assert [s["step"] for s in selections] == [0, 2]  # k·⌊U/K⌋ with U = 5, K = 2
    assert _releases(trainer.ledger) == {SELECTION_STAGE: 4, "dp-frost": 5}
    assert [g.name for g in trainer.ledger.mechanisms] == [SELECTION_STAGE, "dp-frost"] * 2
    partitions = {p.name: p for p in model_partitions(trainer.model)}
    union = {n for s in selections for name in s["partitions"] for n in partitions[name].parameter_names}
    assert trainer.trained_parameter_names == union | {"classifier.weight", "classifier.bias"}


def test_single_shot_spends_one_round_per_selection(tmp_path):
    trainer = _trainer(
        tmp_path, dp=dataclasses.replace(FROST, single_shot=True), per_device_train_batch_size=16, max_steps=1
    )
    assert trainer.plan[SELECTION_STAGE].steps == 1
    trainer.train()
    assert trainer.ledger.mechanisms[0].steps == 1 and trainer.privacy_report()["method_details"]["selected_partitions"]


@pytest.mark.parametrize("factory", [tiny.gpt2, tiny.llama])
def test_causal_lms_select_and_train(tmp_path, factory):
    tok = tiny.tokenizer()
    model = factory()
    before = snapshot(model)
    trainer = PrivateTrainer(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=16, max_steps=2),
        train_dataset=tiny.lm_dataset(N),
        dp_config=dataclasses.replace(FROST, unfreeze_ratio=0.5),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    trainer.train()
    selected = trainer.privacy_report()["method_details"]["selected_partitions"]
    assert selected and _changed(before, model) == trainer.trained_parameter_names  # no head: the selection alone


def test_a_resume_with_the_budget_spent_still_saves_the_selection(tmp_path):
    dp = dataclasses.replace(FROST, noise_multiplier=None, target_epsilon=4.0)
    first = _trainer(tmp_path, dp=dp, per_device_train_batch_size=16, max_steps=3, save_strategy="steps", save_steps=3)
    first.train()
    second = _trainer(tmp_path, dp=dp, per_device_train_batch_size=16, max_steps=3)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))  # no step left: nothing trains
    assert second.trained_parameter_names == first.trained_parameter_names
    second.save_model(str(tmp_path / "final"))
    assert private_adapter_names(tmp_path / "final") == first.trained_parameter_names


def test_the_logged_epsilon_never_passes_the_target(tmp_path):
    """The per-step ε never looks past the budget's end (selection rounds included in the budget)."""
    dp = dataclasses.replace(FROST, noise_multiplier=None, target_epsilon=4.0, noise_seed=None)  # a run that logs ε
    trainer = _trainer(tmp_path, dp=dp, per_device_train_batch_size=16, max_steps=12)
    trainer.train()
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "epsilon" in entry]
    assert len(logged) >= 12 and max(logged) <= 4.0 + 1e-9
