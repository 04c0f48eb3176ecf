"""Tier-0 contract tests of the DP mechanism: sensitivity, noise, coverage, RNG independence.

Each statistical check is a function returning a verdict, so the mutation tests below can show that it fails
on a deliberately broken mechanism: a test that cannot fail proves nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from transformers import DataCollatorWithPadding

from hf_private import DPConfig
from hf_private.engine import PerExampleGradientEngine
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.helpers import make_trainer, snapshot

CLIP = 0.5


# ---------------------------------------------------------------- sensitivity
def _clipped_sum(engine, model, batch) -> torch.Tensor:
    engine.reset()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with engine.recording(batch["input_ids"].shape[0]):
        default_per_example_loss(model, model(**inputs), batch["labels"]).sum().backward()
    engine.finish_backward()
    return torch.cat([engine.clipped_sums[p].flatten() for _, p in engine.parameters])


def _max_sensitivity(engine, model) -> float:
    """Largest change of the noiseless aggregate when one adversarial example joins a batch."""
    data = tiny.sentiment_dataset(12, seed=3)
    collate = DataCollatorWithPadding(tiny.tokenizer())
    base = collate([{**data[i], "labels": data[i]["label"]} for i in range(8)])
    base.pop("label", None)
    worst = 0.0
    for i in range(8, 12):
        extra = {**data[i], "labels": 1 - data[i]["label"]}  # mislabelled: a large, adversarial gradient
        batch = collate([{**data[j], "labels": data[j]["label"]} for j in range(8)] + [extra])
        batch.pop("label", None)
        delta = _clipped_sum(engine, model, batch) - _clipped_sum(engine, model, base)
        worst = max(worst, delta.norm().item())
    return worst


def test_one_extra_example_moves_the_aggregate_by_at_most_C():
    model = tiny.bert().double().train()
    engine = PerExampleGradientEngine(model, CLIP)
    engine.attach()
    worst = _max_sensitivity(engine, model)
    assert worst <= CLIP * (1 + 1e-9)
    assert worst >= 0.9 * CLIP, "the adversarial example should be clipped to ≈C, else the check is too weak"


def test_mutation_broken_clip_fails_the_sensitivity_check():
    model = tiny.bert().double().train()
    engine = PerExampleGradientEngine(model, CLIP)
    engine.attach()
    engine.max_grad_norm = math.inf  # the deliberate bug: clip skipped
    assert _max_sensitivity(engine, model) > CLIP


# ---------------------------------------------------------------- noise statistics
def _noise_variance_matches(trainer, sigma: float, clip: float, steps: int = 6) -> bool:
    """χ² test that empty-batch updates carry noise of variance σ²C² per coordinate (SGD, lr=1)."""
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    scale = trainer.expected_batch_size
    samples = []
    for _ in range(steps):
        before = [p.detach().clone() for _, p in trainer.engine.parameters]
        optimizer.step()  # nothing recorded by the engine: an empty logical batch
        samples += [((b - p.detach()) * scale).flatten() for b, (_, p) in zip(before, trainer.engine.parameters)]
    noise = torch.cat(samples).double()
    n = noise.numel()
    statistic = (noise.pow(2).sum() / (sigma * clip) ** 2).item()  # ~ χ²(n) under the null
    low, high = stats.chi2.ppf(1e-6, n), stats.chi2.ppf(1 - 1e-6, n)
    return low < statistic < high and abs(noise.mean().item()) < 5 * sigma * clip / math.sqrt(n)


def _sgd_trainer(tmp_path, sigma, clip):
    trainer = make_trainer(
        tmp_path,
        dp=DPConfig(noise_multiplier=sigma, max_grad_norm=clip),
        learning_rate=1.0,
        optim="sgd",
        weight_decay=0.0,
    )
    return trainer


def test_empty_batch_noise_has_variance_sigma2_C2(tmp_path):
    trainer = _sgd_trainer(tmp_path, sigma=0.7, clip=0.3)
    assert _noise_variance_matches(trainer, 0.7, 0.3)


@pytest.mark.parametrize("bug", ["missing-noise", "noise-divided-by-batch"])
def test_mutation_broken_noise_fails_the_noise_check(tmp_path, bug):
    trainer = _sgd_trainer(tmp_path, sigma=0.7, clip=0.3)
    trainer.create_optimizer()
    if bug == "missing-noise":
        trainer.optimizer.noise_multiplier = 0.0
    else:
        trainer.optimizer.noise_multiplier = 0.7 / trainer.expected_batch_size
    assert not _noise_variance_matches(trainer, 0.7, 0.3)


# ---------------------------------------------------------------- coverage
def test_only_noised_tensors_change_frozen_and_buffers_bit_identical(tmp_path):
    model = tiny.bert()
    for name, p in model.named_parameters():
        if name.startswith("bert.embeddings") or ".layer.0." in name:
            p.requires_grad_(False)
    before = snapshot(model)
    trainer = make_trainer(tmp_path, model=model, max_steps=3)
    trainer.train()
    after = snapshot(model)
    trainable = {f"param:{n}" for n, p in model.named_parameters() if p.requires_grad}
    for key, value in before.items():
        if key in trainable:
            assert not torch.equal(value, after[key]), f"{key} is trainable but did not move"
        else:
            assert torch.equal(value, after[key]), f"{key} changed without going through the DP aggregator"


# ---------------------------------------------------------------- RNG independence
def _params_after_one_step(tmp_path, noise_seed):
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, noise_seed=noise_seed), max_steps=1, seed=0)
    trainer.train()
    return torch.cat([p.detach().flatten() for _, p in trainer.engine.parameters])


def test_noise_does_not_derive_from_args_seed(tmp_path):
    first = _params_after_one_step(tmp_path / "a", None)
    second = _params_after_one_step(tmp_path / "b", None)
    assert not torch.equal(first, second), "same args.seed gave the same noise: the noise is predictable"


def test_explicit_test_seed_is_reproducible(tmp_path):
    first = _params_after_one_step(tmp_path / "a", 123)
    second = _params_after_one_step(tmp_path / "b", 123)
    assert torch.equal(first, second)
