"""DP-FP through the trainer: the noise point, the representation mechanism (training only), sound mode's formal
guarantee over a frozen encoder, and paper mode's honesty: no ε anywhere, the CLT figure only as an estimate, and the
leak a canary token shows.

The CLT arithmetic: test_dpfp_clt.py; the shared contracts for sound mode: test_method_conformance.py; the audit that
refutes paper mode's CLT figure: test_audit.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard

from hf_private import DPFPConfig
from hf_private.methods.dpfp.clt import clt_noise_multiplier
from hf_private.privacy.events import NO_GUARANTEE
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot

SOUND = DPFPConfig(target_epsilon=3.0, max_grad_norm=1.0)
PAPER = dataclasses.replace(SOUND, mode="paper")


def _trainer(tmp_path, dp=SOUND, model=None, dataset=None, **overrides):
    return make_trainer(
        tmp_path, model=model if model is not None else tiny.bert(), dp=dp, dataset=dataset, **overrides
    )


def test_bad_knobs_are_refused_by_name():
    for bad, match in [
        ({"mode": "fast"}, "mode"),
        ({"representation_clip": 0.0}, "representation_clip"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"noise_point": "input:"}, "noise_point"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(SOUND, **bad)


@pytest.mark.parametrize(
    ("factory", "point", "head"),
    [
        (tiny.bert, "bert.pooler", {"classifier.weight", "classifier.bias"}),
        (tiny.roberta, "input:classifier.out_proj", {"classifier.out_proj.weight", "classifier.out_proj.bias"}),
    ],
)
def test_the_papers_noise_point_and_the_head_above_it(tmp_path, factory, point, head):
    trainer = _trainer(tmp_path, model=factory())
    assert trainer.dp_method.noise_point == point
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == head


def test_an_undefined_noise_point_is_refused_with_the_way_to_name_one(tmp_path):
    with pytest.raises(ValueError, match="noise_point"):
        DPFPConfig(target_epsilon=3.0).build_method().prepare_model(tiny.gpt2())
    with pytest.raises(ValueError, match="has no module 'bert.nowhere'"):
        _trainer(tmp_path, dp=dataclasses.replace(SOUND, noise_point="bert.nowhere"))
    trainer = _trainer(tmp_path, dp=dataclasses.replace(SOUND, noise_point="input:classifier"))
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == {
        "classifier.weight",
        "classifier.bias",
    }


def test_representations_are_clipped_and_noised_in_training_only(tmp_path):
    trainer = _trainer(tmp_path, dp=dataclasses.replace(SOUND, representation_clip=0.1))
    model, seen = trainer.model, []
    handle = model.classifier.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    batch = {"input_ids": torch.randint(4, tiny.VOCAB_SIZE, (512, 6))}
    with torch.no_grad():
        model.train()
        model(**batch)
        model.eval()
        model(**batch)
        model(**batch)
    handle.remove()
    noisy, clean, again = seen
    assert torch.equal(clean, again)  # evaluation: no noise, no clip
    clipped = clean * (0.1 / clean.norm(dim=1, keepdim=True)).clamp(max=1)
    sigma = trainer.dp_method.representation_noise_multiplier
    assert sigma == clt_noise_multiplier(3.0, trainer.delta, trainer.sample_rate, trainer.planned_steps)
    std = (noisy - clipped).std().item()
    assert abs(std / (sigma * 0.1) - 1) < 0.05  # 16k values: the sample std is within 5% with overwhelming odds


def test_sound_mode_has_a_formal_epsilon_and_a_frozen_encoder(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3)
    before = snapshot(trainer.model)
    trainer.train()
    report = trainer.privacy_report()
    assert report["guarantee"] == "formal" and 0 < report["epsilon"] <= 3.0
    changed = {k for k, v in snapshot(trainer.model).items() if not torch.equal(v, before[k])}
    assert changed == {"param:classifier.weight", "param:classifier.bias"}


def test_paper_mode_reports_no_epsilon_anywhere(tmp_path, caplog):
    trainer = _trainer(tmp_path, dp=PAPER, max_steps=3)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "no finite differential privacy guarantee" in caplog.text
    report = trainer.privacy_report()
    assert "epsilon" not in report and report["guarantee"] == "none" and "paper mode" in report["guarantee_note"]
    assert all(m["mechanism"] == NO_GUARANTEE for m in report["mechanisms"])
    figures = report["not_a_guarantee"]
    assert figures["clt_approximation"]["value"] == pytest.approx(3.0, abs=1e-6)  # the paper's calibration
    assert figures["representation_releases_alone"]["value"] > figures["clt_approximation"]["value"]  # CLT under-states
    assert not any("epsilon" in entry for entry in trainer.state.log_history)
    trainer.save_model()
    card = ModelCard.load(tmp_path / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert "epsilon" not in privacy and privacy["guarantee"] == "none"
    assert privacy["not_a_guarantee"]["clt_approximation"]["value"] == figures["clt_approximation"]["value"]
    assert "No formal differential privacy guarantee holds for this model" in card.text


def _canary_run(tmp_path, dp, with_canary: bool):
    """A unique token (id VOCAB_SIZE - 1, used nowhere else) in one training example, or not."""
    data = tiny.sentiment_dataset(64)
    rows = data.to_dict()
    if with_canary:
        rows["input_ids"][0] = [*rows["input_ids"][0][:-1], tiny.VOCAB_SIZE - 1, rows["input_ids"][0][-1]]
        rows["attention_mask"][0] = [1] * len(rows["input_ids"][0])
    trainer = _trainer(
        tmp_path,
        dp=dataclasses.replace(dp, noise_seed=4),
        dataset=Dataset.from_dict(rows),
        max_steps=40,
        per_device_train_batch_size=16,
        weight_decay=0.0,
        learning_rate=1e-2,
    )
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(bool((kwargs["input_ids"] == tiny.VOCAB_SIZE - 1).any())), with_kwargs=True
    )
    row = trainer.model.get_input_embeddings().weight[tiny.VOCAB_SIZE - 1]
    before = row.detach().clone()
    trainer.train()
    return not torch.equal(row.detach(), before), any(seen)


def test_paper_mode_leaks_a_canary_token_that_sound_mode_does_not(tmp_path):
    """The canary's embedding row moves if and only if the canary was sampled (paper mode): membership for free."""
    moved, sampled = _canary_run(tmp_path / "with", PAPER, with_canary=True)
    assert sampled and moved
    moved, sampled = _canary_run(tmp_path / "without", PAPER, with_canary=False)
    assert not sampled and not moved
    moved, sampled = _canary_run(tmp_path / "sound", SOUND, with_canary=True)
    assert sampled and not moved  # frozen below the noise point: nothing to read
