"""Adaptive clipping (Andrew et al. 2021): the joint release's noise, the geometric update, the run end to end."""

from __future__ import annotations

import math
import os

import pytest
import torch
from huggingface_hub import ModelCard

from hf_private import DPConfig
from hf_private.engine.reducers import FlatL2ClipReducer
from hf_private.methods.bitfit import BitFitConfig
from hf_private.methods.frost import FrostConfig
from hf_private.privacy import MechanismGroup, PrivacyLedger, compute_epsilon
from hf_private.privacy.adaptive_clip import (
    AdaptiveClipError,
    effective_noise_multiplier,
    geometric_update,
    gradient_noise_multiplier,
)
from hf_private.run.adaptive_clip import CountingClipReducer
from tests.support import tiny
from tests.support.helpers import KillAtStep, make_trainer


def adaptive(**overrides) -> DPConfig:
    settings = dict(target_epsilon=8.0, max_grad_norm="adaptive", initial_max_grad_norm=0.05)
    return DPConfig(**{**settings, **overrides})


# ---------------------------------------------------------------------- (1) the paper's formula
@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 12.8), (0.7, 5.0), (2.0, 1.01), (1.3, 100.0)])
def test_gradient_noise_keeps_the_effective_multiplier(z, sigma_b):
    """Theorem 1: clipped sum (sensitivity C, noise z_Δ·C) and centred count (sensitivity ½, noise σ_b) are one Gaussian
    mechanism at z with z⁻² = z_Δ⁻² + (2σ_b)⁻²."""
    z_grad = gradient_noise_multiplier(z, sigma_b)
    assert z_grad**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-12)
    assert z_grad > z
    assert effective_noise_multiplier(z_grad, sigma_b) == pytest.approx(z, rel=1e-12)
    # The joint sensitivity in units of each part's noise std, √((C/(z_Δ C))² + (½/σ_b)²), is exactly 1/z.
    assert math.hypot(1 / z_grad, 0.5 / sigma_b) == pytest.approx(1 / z, rel=1e-12)


def test_paper_default_count_noise_costs_little_gradient_noise():
    """σ_b = m/20 at m = 256, z = 1: z_Δ = (1 − (2·12.8)⁻²)^(−1/2) ≈ 1.00076."""
    assert gradient_noise_multiplier(1.0, 256 / 20) == pytest.approx((1 - 25.6**-2) ** -0.5, rel=1e-12)
    assert gradient_noise_multiplier(1.0, 256 / 20) < 1.001


@pytest.mark.parametrize("sigma_b", [0.5, 0.3, 0.0])
def test_count_noise_too_small_for_the_multiplier_is_refused(sigma_b):
    with pytest.raises(AdaptiveClipError, match="must exceed z/2.*clip_count_noise"):
        gradient_noise_multiplier(1.0, sigma_b)


# ---------------------------------------------------------------------- (2) the geometric update converges
@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("start", [1e-3, 50.0])
def test_without_noise_c_converges_to_the_target_quantile(quantile, start):
    """From 2-3 orders of magnitude off, the exact unclipped fraction of a fixed set of norms settles near γ."""
    generator = torch.Generator().manual_seed(0)
    norms = torch.exp(torch.randn(2000, generator=generator, dtype=torch.float64))  # log-normal, median 1
    clip = start
    for _ in range(400):
        fraction = float((norms <= clip).double().mean())
        clip = geometric_update(clip, fraction, quantile, 0.2)
    assert abs(float((norms <= clip).double().mean()) - quantile) < 0.03
    assert clip == pytest.approx(float(norms.quantile(quantile)), rel=0.1)


def test_counting_reducer_counts_centred_unclipped_units():
    """Σ(b_i − ½) over the chunks since the last pop; a non-finite norm counts as clipped; reset forgets the count."""

    class Chunk:
        def __init__(self, norms):
            self.norms = norms

    reducer = CountingClipReducer(1.0)
    FlatL2ClipReducer_reduce = FlatL2ClipReducer.reduce
    try:
        FlatL2ClipReducer.reduce = lambda self, chunk: chunk.norms  # the flat clip itself is tested elsewhere
        reducer.reduce(Chunk(torch.tensor([0.5, 1.0, 2.0])))  # two unclipped of three: +0.5
        reducer.reduce(Chunk(torch.tensor([float("nan"), 0.1])))  # one of two: 0
        assert reducer.pop_centred_count(torch.device("cpu")).item() == 0.5
        assert reducer.pop_centred_count(torch.device("cpu")).item() == 0.0  # popped: nothing left
        reducer.reduce(Chunk(torch.tensor([3.0])))
        reducer.reset()
        assert reducer.pop_centred_count(torch.device("cpu")).item() == 0.0
    finally:
        FlatL2ClipReducer.reduce = FlatL2ClipReducer_reduce


# ---------------------------------------------------------------------- (3), (4) through the public API
class _StepRecorder:
    """An instrument: per step, the C every chunk was clipped at, and the C and σ the optimizer noised with."""

    def __init__(self) -> None:
        self.chunk_clips: list[float] = []
        self.steps: list[tuple[list[float], float, float]] = []

    def attach_engine(self, engine) -> None:
        engine.add_norm_hook(lambda norms: self.chunk_clips.append(engine.max_grad_norm))

    def attach_optimizer(self, optimizer) -> None:
        def before_inner_step() -> None:
            self.steps.append((self.chunk_clips, optimizer.max_grad_norm, optimizer.noise_multiplier))
            self.chunk_clips = []

        optimizer.add_pre_step_hook(before_inner_step)


def _per_example_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")


def test_c_adapts_is_logged_each_step_and_the_card_recomputes_epsilon(tmp_path):
    dp = adaptive()
    trainer = make_trainer(
        tmp_path, dataset=tiny.sentiment_dataset(800), dp=dp, max_steps=6, per_device_train_batch_size=100
    )
    recorder = _StepRecorder()
    trainer.privacy_run.add_instrument(recorder)
    trainer.train()
    run = trainer.privacy_run
    z = run.noise_multiplier

    # C changes, is logged on every step's line, and is the C each step clipped at and noised with.
    logged = [entry["max_grad_norm"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 6 and len(set(logged)) == 6
    assert logged[0] == 0.05 and run.adaptive_clip.clip not in logged
    assert len(recorder.steps) == 6
    for (chunk_clips, noised_clip, noised_sigma), clip in zip(recorder.steps, logged):
        assert chunk_clips and set(chunk_clips) == {clip}  # (4) every unit clipped to the C the noise is scaled to
        assert noised_clip == clip
        assert noised_sigma == pytest.approx(gradient_noise_multiplier(z, 0.05 * 100), rel=1e-12) and noised_sigma > z
    # C of 0.05 is far below the tiny model's norms: nearly every example is clipped, so C grows.
    assert logged == sorted(logged)

    # The ledger: one Poisson-subsampled Gaussian at the effective z, its ε the accountant's for (z, q, 6).
    (group,) = run.ledger.mechanisms
    assert (group.noise_multiplier, group.sample_rate, group.steps, group.max_grad_norm) == (z, 100 / 800, 6, None)
    assert group.adaptive_clip["count_noise_std"] == 5.0
    plain = compute_epsilon([MechanismGroup("dp-sgd", z, 100 / 800, 6)], run.delta, "prv")
    report = trainer.privacy_report()
    assert report["epsilon"] == pytest.approx(plain, rel=1e-12) and report["epsilon"] <= 8.0
    facts = report["adaptive_clipping"]
    assert facts["initial_max_grad_norm"] == 0.05 and facts["final_max_grad_norm"] == run.adaptive_clip.clip
    assert facts["updates"] == 6 and facts["target_quantile"] == 0.5

    trainer.save_model()
    card = ModelCard.load(os.path.join(tmp_path, "README.md"))
    privacy = card.data.to_dict()["privacy"]
    (mechanism,) = privacy["mechanisms"]
    assert {k: mechanism[k] for k in ("noise_multiplier", "sample_rate", "steps")} == {
        "noise_multiplier": z,
        "sample_rate": 0.125,
        "steps": 6,
    }
    recomputed = compute_epsilon([MechanismGroup.from_dict(m) for m in privacy["mechanisms"]], privacy["delta"], "prv")
    assert recomputed == pytest.approx(privacy["epsilon"], rel=1e-9)
    assert privacy["adaptive_clipping"]["final_max_grad_norm"] == run.adaptive_clip.clip
    assert "| adaptive |" in card.text and "towards the 0.5 quantile" in card.text


def test_the_released_sum_moves_by_at_most_the_adapted_c(tmp_path):
    """(4) After C has moved, removing one example from a batch moves the engine's clipped sum by at most the current
    C, the C the optimizer scales the noise to."""
    trainer = make_trainer(
        tmp_path, dataset=tiny.sentiment_dataset(400), dp=adaptive(), max_steps=3, per_device_train_batch_size=50
    )
    trainer.train()
    run = trainer.privacy_run
    clip = run.adaptive_clip.clip
    assert clip != 0.05 and run.optimizer.max_grad_norm == clip and run.engine.max_grad_norm == clip
    assert isinstance(run.engine.reducer, CountingClipReducer)
    data = tiny.sentiment_dataset(6, seed=3)
    batch = trainer.data_collator([data[i] for i in range(6)])
    model, engine = trainer.model, run.engine
    model.train()
    sums = []
    for kept in (list(range(6)), list(range(1, 6))):
        sub = {k: v[kept] for k, v in batch.items()}
        for _ in range(2):  # the verifying chunk, then the ghost-differentiated one
            with engine.recording(len(kept)):
                _per_example_loss(model, sub).backward()
            norms = engine.finish_backward()
            popped = engine.pop_clipped_sums()
        engine.reset()
        sums.append(torch.cat([s.double().flatten() for s in popped.values()]))
    assert float(norms.max()) > clip  # the removed example's neighbours are clipped at this C
    assert (sums[0] - sums[1]).norm().item() <= clip * 1.0001


# ---------------------------------------------------------------------- (5) resume


def test_resume_continues_from_the_adapted_c(tmp_path):
    dp = adaptive(noise_seed=0)  # replayable up to the checkpoint (a resumed run's streams start afresh)
    args = dict(dataset=tiny.sentiment_dataset(400), dp=dp, max_steps=6, per_device_train_batch_size=50)
    full = make_trainer(tmp_path / "full", **args)
    full.train()
    full_clips = [entry["max_grad_norm"] for entry in full.state.log_history if "loss" in entry]

    interrupted = make_trainer(tmp_path / "run", save_strategy="steps", save_steps=3, **args)
    interrupted.add_callback(KillAtStep(at_step=4))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    saved = PrivacyLedger.load(tmp_path / "run" / "checkpoint-3" / "privacy_ledger.json")
    assert saved.clip_norm["updates"] == 3 and saved.clip_norm["current"] != 0.05

    resumed = make_trainer(tmp_path / "run", save_strategy="steps", save_steps=3, **args)
    resumed.train(resume_from_checkpoint=True)
    resumed_clips = {entry["step"]: entry["max_grad_norm"] for entry in resumed.state.log_history if "loss" in entry}
    assert resumed_clips[4] == saved.clip_norm["current"] == full_clips[3]  # step 4 clipped at the adapted C
    assert resumed.privacy_run.adaptive_clip.updates == 6
    assert resumed.privacy_report()["adaptive_clipping"]["initial_max_grad_norm"] == 0.05


# ---------------------------------------------------------------------- (6) refusals
def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="needs initial_max_grad_norm.*median_gradient_norm"):
        DPConfig(target_epsilon=8.0, max_grad_norm="adaptive")
    with pytest.raises(ValueError, match="'adaptive'"):
        DPConfig(target_epsilon=8.0, max_grad_norm="auto")
    with pytest.raises(ValueError, match="initial_max_grad_norm is the starting C"):
        DPConfig(target_epsilon=8.0, initial_max_grad_norm=1.0)
    with pytest.raises(ValueError, match="target_quantile"):
        adaptive(target_quantile=1.0)
    with pytest.raises(ValueError, match="not supported by method 'dp-frost'.*selection"):
        FrostConfig(target_epsilon=8.0, max_grad_norm="adaptive", initial_max_grad_norm=1.0)
    with pytest.raises(ValueError, match="not supported by method 'dp-bitfit'"):
        BitFitConfig(target_epsilon=8.0, max_grad_norm="adaptive", initial_max_grad_norm=1.0)
    with pytest.raises(ValueError, match="user_sampling='example'.*k/2"):
        adaptive(privacy_unit="user", user_column="user", user_sampling="example", max_examples_per_user=2)
    # User-level sampling (ULS) clips and counts users: each user moves the count by ½, as an example does.
    adaptive(privacy_unit="user", user_column="user")


def test_a_count_noise_too_small_for_the_calibrated_multiplier_is_refused_at_construction(tmp_path):
    with pytest.raises(AdaptiveClipError, match="clip_count_noise"):
        make_trainer(tmp_path, dp=adaptive(target_epsilon=1.0, clip_count_noise=0.01), max_steps=4)


def test_the_config_round_trips(tmp_path):
    dp = adaptive(target_quantile=0.7, clip_learning_rate=0.1)
    dp.save_pretrained(tmp_path)
    assert DPConfig.from_pretrained(tmp_path) == dp
