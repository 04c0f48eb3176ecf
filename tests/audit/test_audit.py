"""The privacy audit: the one-run bound, the canary audit end to end, its power against broken trainers, a
one-step distinguishing test of the core mechanism (Tier 1), and the audit entry of the model card.

A passing audit proves nothing by itself, so every audit here is paired with deliberately broken runs (bugs
injected by monkeypatching, never by switches in the library) that the same audit must refute.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import random
import subprocess
import sys
import tomllib

import pytest
import torch
from huggingface_hub import ModelCard
from scipy import optimize, stats
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

from hf_private import BitFitConfig, DPConfig, DPFPConfig
from hf_private.audit import (
    AuditCeiling,
    AuditResult,
    build_canaries,
    count_correct,
    epsilon_from_error_rates,
    gdp_delta,
    gdp_epsilon,
    one_run_epsilon_lower_bound,
    one_run_gdp_p_value,
    one_run_mu_lower_bound,
    one_run_p_value,
)
from hf_private.cli.audit import main, run_audit
from hf_private.engine import PerExampleGradientEngine
from hf_private.integrations.losses import default_per_example_loss
from hf_private.privacy import GaussianNoise, MechanismGroup, PrivacyLedger, compute_epsilon
from hf_private.release.model_card import privacy_metadata
from tests.support import tiny
from tests.support.helpers import make_trainer, training_args

CLAIMED_EPSILON = 2.0
DELTA = 1e-5
BATCH = 128
# Natural per-example gradient norms of the tiny BERT are ≈ 1.1, so C = 0.01 clips every example hard, as in real DP
# fine-tuning: skipping the clip is then a gross bug (×100 sensitivity) that an audit must be able to see.
CLIP = 0.01
AUDIT_ARGS = dict(
    per_device_train_batch_size=BATCH,
    num_train_epochs=3,
    learning_rate=0.5,
    optim="sgd",
    weight_decay=0.0,
    logging_steps=10_000,
)
CANARIES, K_PLUS = 300, 100


# ---------------------------------------------------------------- the bound (Steinke et al. 2023)
def test_bound_reproduces_the_reference_values_of_the_spec():
    # methods_spec §8.2 / §8.5: 200 of 200 right with m = 1000 gives 4.17 at δ = 1e-5 and only 3.08 at δ = 3.3e-4.
    assert one_run_epsilon_lower_bound(1000, 200, 200, 1e-5) == pytest.approx(4.17, abs=0.01)
    assert one_run_epsilon_lower_bound(1000, 200, 200, 3.3e-4) == pytest.approx(3.08, abs=0.01)
    assert one_run_epsilon_lower_bound(1000, 200, 112, 1e-5) == 0.0  # chance-level guessing refutes nothing


def test_bound_is_the_edge_of_rejection():
    eps = one_run_epsilon_lower_bound(500, 100, 90, 1e-5, confidence=0.95)
    assert one_run_p_value(500, 100, 90, eps - 1e-3, 1e-5) < 0.05 <= one_run_p_value(500, 100, 90, eps + 1e-3, 1e-5)
    assert one_run_epsilon_lower_bound(500, 100, 90, 1e-5, confidence=0.99) < eps
    assert one_run_p_value(500, 100, 0, 0.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="correct"):
        one_run_p_value(10, 5, 6, 1.0, 0.0)


def test_the_ceiling_of_the_epsilon_delta_test_is_the_one_the_literature_states():
    # every guess right, all canaries guessed, α = 0.05: ≈ 5.8 with 1,000 canaries and ≈ 8.1 with 10,000 (δ = 0)
    assert one_run_epsilon_lower_bound(1000, 1000, 1000, 0.0) == pytest.approx(5.8, abs=0.05)
    assert one_run_epsilon_lower_bound(10_000, 10_000, 10_000, 0.0) == pytest.approx(8.1, abs=0.05)


def test_the_gaussian_profile_reads_the_gdp_literature():
    # μ-GDP is (ε, δ(ε))-DP with δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su): μ = 1 at ε = 1
    assert gdp_delta(1.0, 1.0) == pytest.approx(0.12693674, abs=1e-7)
    assert gdp_delta(1.0, gdp_epsilon(1.0, 1e-5)) == pytest.approx(1e-5, rel=1e-6)
    assert gdp_epsilon(0.5, 1e-5) < gdp_epsilon(1.0, 1e-5) < gdp_epsilon(2.0, 1e-5)
    assert gdp_epsilon(0.0, 1e-5) == 0.0


@pytest.mark.parametrize(
    "canaries, guesses, correct",
    [(1000, 200, 150), (1000, 200, 170), (1000, 200, 200), (300, 100, 80), (10_000, 2_000, 2_000)],
)
def test_the_gdp_bound_certifies_at_least_the_epsilon_delta_bound_on_the_same_guesses(canaries, guesses, correct):
    """A μ whose ε at δ is below the (ε, δ) bound has δ_μ(ε_lb) ≤ δ there, so it is rejected too."""
    epsilon = one_run_epsilon_lower_bound(canaries, guesses, correct, DELTA)
    mu = one_run_mu_lower_bound(canaries, guesses, correct, DELTA)
    assert gdp_epsilon(mu, DELTA) >= epsilon - 1e-6 and epsilon > 0  # equal up to the bisections


def test_the_gdp_bound_is_the_edge_of_rejection_and_chance_refutes_nothing():
    mu = one_run_mu_lower_bound(500, 100, 90, DELTA)
    assert (
        one_run_gdp_p_value(500, 100, 90, mu * 0.99, DELTA)
        < 0.05
        <= one_run_gdp_p_value(500, 100, 90, mu * 1.01, DELTA)
    )
    assert one_run_mu_lower_bound(1000, 200, 112, DELTA) == 0.0
    assert one_run_gdp_p_value(500, 100, 0, 1.0, DELTA) == 1.0


def _gdp_refutations(shift: float, mu: float, trials: int, level: float, canaries: int = 1000, k: int = 100) -> int:
    """Of `trials` one-run audits of a mechanism whose every canary's score is N(shift, 1) when included (probability
    ½), N(0, 1) otherwise (exactly shift-GDP per canary), how many refute "μ-GDP" at `level` (k top and k bottom
    guesses). The p-value depends on the trial only through the number of correct guesses: computed once per count."""
    generator = torch.Generator().manual_seed(0)
    p_value = functools.cache(lambda correct: one_run_gdp_p_value(canaries, 2 * k, correct, mu, DELTA))
    refuted = 0
    for _ in range(trials):
        included = torch.rand(canaries, generator=generator) < 0.5
        scores = torch.randn(canaries, generator=generator, dtype=torch.float64) + shift * included
        refuted += p_value(count_correct(scores, included, k, k)[1]) < level
    return refuted


def test_an_exactly_gdp_mechanism_is_refuted_at_most_at_the_level():
    """The μ-GDP test is a valid level-α test: on an exactly μ-GDP mechanism it refutes μ in at most a fraction α of
    audits (the outside review counted 0 of 400 at α = 0.05); a mechanism at 3μ is refuted far more often than a valid
    test could refute a true claim, so the count can fail."""
    trials, level, mu = 400, 0.05, 1.0
    chance = stats.binom.ppf(1 - 1e-3, trials, level)  # a level-α test refutes more than this with probability < 1e-3
    assert _gdp_refutations(mu, mu, trials, level) <= chance
    assert _gdp_refutations(3 * mu, mu, trials, level) > chance


def test_guesses_are_top_and_bottom_scores():
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = torch.tensor([True, False, True, False, False, True])
    assert count_correct(scores, included, 2, 0) == (2, 1)
    assert count_correct(scores, included, 1, 2) == (3, 1 + 1)
    with pytest.raises(ValueError):
        count_correct(scores, included, 4, 3)


def test_error_rate_bound_of_a_perfect_test_is_limited_by_the_trials():
    assert 6.0 < epsilon_from_error_rates(0, 2000, 0, 2000, DELTA) < 6.6
    assert epsilon_from_error_rates(1000, 2000, 1000, 2000, DELTA) == 0.0


# ---------------------------------------------------------------- one-run canary audit (Tier 2)
def _audit(
    output_dir, config_cls=DPConfig, seed: int = 0, canaries: int = CANARIES, k_plus: int | None = K_PLUS
) -> AuditResult:
    dp = config_cls(target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000 + seed)
    tok = tiny.tokenizer()
    return run_audit(
        tiny.bert,
        tiny.sentiment_dataset(400, seed=1),
        dp,
        training_args(output_dir, **AUDIT_ARGS),
        canaries=canaries,
        k_plus=k_plus,
        seed=seed,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
    )


@pytest.fixture(scope="module")
def dpsgd_audit(tmp_path_factory) -> AuditResult:
    return _audit(tmp_path_factory.mktemp("audit-dpsgd"))


def test_dp_sgd_passes_the_audit(dpsgd_audit):
    result = dpsgd_audit
    assert result.claimed_epsilon == pytest.approx(CLAIMED_EPSILON, abs=0.05)
    assert {b.score for b in result.bounds} == {"white-box", "black-box"}
    assert all(b.guesses == K_PLUS and b.confidence == pytest.approx(0.975) for b in result.bounds)
    assert 0.3 * CANARIES < result.included < 0.7 * CANARIES
    assert result.epsilon_lower_bound < CLAIMED_EPSILON and not result.refutes_claim
    # the μ-GDP test on the same guesses certifies at least as much, and neither reaches the ceiling of 100 guesses
    for bound in result.bounds:
        assert bound.gdp_epsilon_lower_bound >= bound.epsilon_lower_bound - 1e-6
        assert bound.gdp_epsilon_lower_bound == pytest.approx(gdp_epsilon(bound.mu_lower_bound, result.delta))
    ceiling = result.ceiling
    assert ceiling.epsilon == pytest.approx(one_run_epsilon_lower_bound(CANARIES, K_PLUS, K_PLUS, result.delta, 0.975))
    assert ceiling.gdp_epsilon >= ceiling.epsilon - 1e-6 and result.gdp_epsilon_lower_bound < ceiling.gdp_epsilon


def test_bitfit_passes_the_audit(tmp_path):
    result = _audit(tmp_path, BitFitConfig)
    # BiTFiT freezes the embedding: its white-box score comes from gradient canaries
    # (tests/audit/test_gradient_canaries.py)
    assert [b.score for b in result.bounds] == ["white-box-gradient", "black-box"]
    assert all(b.confidence == pytest.approx(0.975) for b in result.bounds)
    assert result.epsilon_lower_bound < CLAIMED_EPSILON
    # two sets of CANARIES: `included` counts both (it may exceed `canaries`), and the summary says so
    assert result.canary_sets == ("token", "gradient")
    assert 0.3 * 2 * CANARIES < result.included < 0.7 * 2 * CANARIES
    assert (
        f"Canaries: 2 sets of {CANARIES} (token and gradient canaries), each included in the training set "
        f"independently with probability 1/2: {result.included} of {2 * CANARIES} included."
    ) == result.canary_summary()


def test_too_few_trainable_coordinates_for_gradient_canaries_skip_the_white_box_score_with_a_warning(tmp_path, caplog):
    """The tiny BERT's BiTFiT trains 706 coordinates: 1000 gradient canaries cannot have one each."""
    dp = BitFitConfig(target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000)
    tok = tiny.tokenizer()
    with caplog.at_level(logging.WARNING, logger="hf_private"):
        result = run_audit(
            tiny.bert,
            tiny.sentiment_dataset(100, seed=1),
            dp,
            training_args(tmp_path, **{**AUDIT_ARGS, "num_train_epochs": 1}),
            canaries=1000,
            seed=0,
            data_collator=DataCollatorWithPadding(tok),
            processing_class=tok,
        )
    assert [b.score for b in result.bounds] == ["black-box"] and result.bounds[0].confidence == 0.95
    assert "706 trainable coordinates cannot give 1000 gradient canaries" in caplog.text


def _skip_clipping(monkeypatch):
    original = PerExampleGradientEngine.__init__

    def broken(self, model, max_grad_norm, **kwargs):
        original(self, model, max_grad_norm, **kwargs)
        self.max_grad_norm = math.inf  # every clip factor becomes 1

    monkeypatch.setattr(PerExampleGradientEngine, "__init__", broken)


def _noise_divided_by(monkeypatch, batch):
    original = GaussianNoise.add_
    monkeypatch.setattr(GaussianNoise, "add_", lambda self, tensors, std: original(self, tensors, std / batch))


BUGS = {
    "noise-not-added": lambda mp: mp.setattr(GaussianNoise, "add_", lambda self, tensors, std: None),
    "clip-skipped": _skip_clipping,
    "noise-divided-by-batch": lambda mp: _noise_divided_by(mp, BATCH),
}


@pytest.mark.parametrize("bug", [None, *sorted(BUGS)], ids=["sound", *sorted(BUGS)])
def test_dp_sgd_is_audited_by_the_embedding_rows_at_the_default_m(tmp_path, monkeypatch, bug):
    """run_audit's defaults (m = 1000, k₊ = 200): a sound run is not refuted; a broken one is, by the white-box score
    of the canaries' embedding rows (the methods that do not always train the embedding, DP-FROST's selections
    included: tests/audit/test_gradient_canaries.py)."""
    if bug is not None:
        BUGS[bug](monkeypatch)
    result = _audit(tmp_path, canaries=1000, k_plus=None)
    white = next(b for b in result.bounds if b.score == "white-box")
    assert white.guesses == 200
    assert_power(result, white, bug)


def assert_power(result: AuditResult, white, bug: str | None) -> None:
    """A sound run at the claim is not refuted; a broken one is, by its white-box score; on every score the μ-GDP
    bound is at least the (ε, δ) one on the same guesses."""
    for bound in result.bounds:
        assert bound.gdp_epsilon_lower_bound >= bound.epsilon_lower_bound - 1e-6
    if bug is None:
        assert result.claimed_epsilon == pytest.approx(CLAIMED_EPSILON, abs=0.05)
        assert result.epsilon_lower_bound < CLAIMED_EPSILON and not result.refutes_claim, result.bounds
    else:
        assert result.refutes_claim and white.epsilon_lower_bound > CLAIMED_EPSILON, (bug, result.bounds)


def _language_model_audit(output_dir, trainer: str) -> AuditResult:
    """New-token canaries in a causal LM (each a sequence of its own token, predicting itself): a tiny GPT-2 under
    PrivateTrainer, or a tiny Llama under privatize(SFTTrainer) on pre-tokenized sequences."""
    dp = DPConfig(target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000)
    common = dict(canaries=CANARIES, k_plus=K_PLUS, seed=0)
    if trainer == "causal-lm":
        tok = tiny.tokenizer()
        return run_audit(
            tiny.gpt2,
            tiny.lm_dataset(400, seed=1),
            dp,
            training_args(output_dir, **AUDIT_ARGS),
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            processing_class=tok,
            **common,
        )
    from trl import SFTConfig, SFTTrainer

    from hf_private import privatize
    from tests.support.helpers import TRL_TEST_ARGS

    args = SFTConfig(str(output_dir), **{**TRL_TEST_ARGS, "max_length": None}, **AUDIT_ARGS)
    return run_audit(
        tiny.llama,
        tiny.lm_dataset(400, seed=1),
        dp,
        args,
        trainer_class=privatize(SFTTrainer),
        processing_class=tiny.chat_tokenizer(),
        **common,
    )


@pytest.mark.parametrize("broken", [False, True], ids=["sound", "noise-not-added"])
@pytest.mark.parametrize("trainer", ["causal-lm", "sft"])
def test_language_model_canaries_audit_private_lm_training(tmp_path, monkeypatch, trainer, broken):
    if broken:
        BUGS["noise-not-added"](monkeypatch)
    result = _language_model_audit(tmp_path, trainer)
    assert {b.score for b in result.bounds} == {"white-box", "black-box"}
    assert result.refutes_claim is broken, result.bounds
    if broken:
        white = next(b for b in result.bounds if b.score == "white-box")
        assert white.correct >= 0.97 * white.guesses and result.epsilon_lower_bound > CLAIMED_EPSILON


def test_dpfp_paper_mode_fails_the_audit(tmp_path):
    """DPFPConfig(mode="paper") trains the encoder below the noise on raw inputs: the canaries' embedding rows give
    ε_lb above the paper's own CLT figure of 2, which the audit refutes."""
    result = _audit(tmp_path, functools.partial(DPFPConfig, mode="paper"))
    assert result.claimed_epsilon == pytest.approx(CLAIMED_EPSILON, abs=1e-6)  # the CLT figure: nothing else claimed
    white = next(b for b in result.bounds if b.score == "white-box")
    assert result.epsilon_lower_bound > CLAIMED_EPSILON and result.refutes_claim
    assert white.correct >= 0.95 * white.guesses  # a sampled canary's row can move against its first direction


# ---------------------------------------------------------------- one-step distinguishing test (Tier 1)
STEP_SIGMA, STEP_CLIP, STEP_BATCH = 2.0, 0.05, 32
SELECTION_TRIALS, TRIALS = 500, 2000


def gaussian_mechanism_epsilon(sigma: float, delta: float) -> float:
    """Exact ε(δ) of one Gaussian mechanism with noise σ·sensitivity (Balle & Wang 2018)."""

    def delta_of(eps):
        return stats.norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)

    return optimize.brentq(lambda eps: delta_of(eps) - delta, 0.0, 100.0)


def _clipped_sums(engine, model, rows) -> dict:
    batch = DataCollatorWithPadding(tiny.tokenizer())(rows)
    labels = batch.pop("labels")
    engine.reset()
    with engine.recording(labels.shape[0]):
        default_per_example_loss(model, model(**batch), labels).sum().backward()
    engine.finish_backward()
    return {p: s.clone() for p, s in engine.pop_clipped_sums().items()}


def _one_step_epsilon(output_dir) -> float:
    """Releases F = clipped sum + noise through the optimizer proxy (q = 1, SGD with lr 1), on D and on D ∪ {x*}.

    Statistic ⟨F − Σ_D clip(g), u⟩ with u the direction of clip(g(x*)); the threshold is chosen on separate trials,
    then Clopper–Pearson bounds on fresh trials give ε_lb.
    """
    model = tiny.bert()
    for name, p in model.named_parameters():  # the pooler and head only: thousands of trials must stay fast
        p.requires_grad_(name.startswith(("bert.pooler", "classifier")))
    dp = DPConfig(noise_multiplier=STEP_SIGMA, max_grad_norm=STEP_CLIP, noise_seed=0)
    trainer = make_trainer(
        output_dir,
        model=model,
        dp=dp,
        learning_rate=1.0,
        optim="sgd",
        weight_decay=0.0,
        per_device_train_batch_size=STEP_BATCH,
    )
    trainer.create_optimizer()
    model, engine, params = trainer.model, trainer.engine, [p for _, p in trainer.engine.parameters]
    data = tiny.sentiment_dataset(9, seed=5)
    rows = [{**data[i], "labels": data[i]["label"]} for i in range(9)]
    rows[-1]["labels"] = 1 - rows[-1]["labels"]  # x*: mislabelled, a large gradient
    without = _clipped_sums(engine, model, rows[:-1])
    with_canary = _clipped_sums(engine, model, rows)
    flat = lambda sums: torch.cat([sums[p].flatten() for p in params])  # noqa: E731
    base, direction = flat(without), flat(with_canary) - flat(without)
    direction = direction / direction.norm()

    def statistic(sums) -> float:
        before = [p.detach().clone() for p in params]
        engine.clipped_sums = {p: s.clone() for p, s in sums.items()}
        trainer.optimizer.step()
        scale = trainer.expected_batch_size  # the proxy divides the noisy sum by it; SGD with lr 1 subtracts it
        released = torch.cat([((b - p.detach()) * scale).flatten() for b, p in zip(before, params)])
        with torch.no_grad():
            for b, p in zip(before, params):
                p.copy_(b)
        return torch.dot(released.double() - base.double(), direction.double()).item()

    def trials(count):
        return (
            torch.tensor([statistic(without) for _ in range(count)]),
            torch.tensor([statistic(with_canary) for _ in range(count)]),
        )

    def best(negatives, positives, threshold):
        return epsilon_from_error_rates(
            int((negatives > threshold).sum()),
            len(negatives),
            int((positives <= threshold).sum()),
            len(positives),
            DELTA,
        )

    neg, pos = trials(SELECTION_TRIALS)
    threshold = max(torch.cat([neg, pos]).tolist(), key=lambda t: best(neg, pos, t))
    neg, pos = trials(TRIALS)
    return best(neg, pos, threshold)


def test_one_step_distinguisher_stays_below_the_gaussian_mechanism_epsilon(tmp_path):
    epsilon = gaussian_mechanism_epsilon(STEP_SIGMA, DELTA)
    assert _one_step_epsilon(tmp_path) <= epsilon


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_mutation_one_step_distinguisher_catches_a_broken_mechanism(tmp_path, monkeypatch, bug):
    if bug == "noise-divided-by-batch":
        _noise_divided_by(monkeypatch, STEP_BATCH)
    else:
        BUGS[bug](monkeypatch)
    assert _one_step_epsilon(tmp_path) > gaussian_mechanism_epsilon(STEP_SIGMA, DELTA)


# ---------------------------------------------------------------- the card and the command line
def test_audit_reaches_the_card_as_a_lower_bound_not_the_guarantee(tmp_path, dpsgd_audit):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.attach_audit(dpsgd_audit)
    trainer.save_model()
    card = ModelCard.load(os.path.join(tmp_path, "README.md"))
    privacy = card.data.to_dict()["privacy"]
    audit = privacy["audit"]
    assert audit["kind"] == "empirical lower bound (not the guarantee)"
    assert audit["epsilon_lower_bound"] == pytest.approx(dpsgd_audit.epsilon_lower_bound, abs=1e-4)
    assert audit["confidence"] == 0.95 and audit["canaries"] == CANARIES and audit["date"] == dpsgd_audit.date
    assert audit["gaussian_dp"]["mu_lower_bound"] == pytest.approx(dpsgd_audit.mu_lower_bound, abs=1e-4)
    assert audit["ceiling"]["epsilon"] == pytest.approx(dpsgd_audit.ceiling.epsilon, abs=1e-4)
    assert set(audit["scores"]["white-box"]["gaussian_dp"]) == {"mu_lower_bound", "epsilon_lower_bound_at_delta"}
    assert "lower bound, not the guarantee" in card.text and "never proves one" in card.text
    assert f"could certify at most ε = {dpsgd_audit.ceiling.epsilon:.3g}" in " ".join(card.text.split())
    # The fixture's audit ran in insecure test mode on the training data: the composed guarantee cannot be formal, so
    # the card carries no ε, only the composed accounting labelled as bounding nothing (not ε_lb either).
    assert privacy["guarantee"] == "none" and "audit run" in privacy["guarantee_note"] and "epsilon" not in privacy
    composed = trainer.privacy_report()["not_a_guarantee"]["accounting_with_a_secret_seed"]["value"]
    assert privacy["not_a_guarantee"]["accounting_with_a_secret_seed"]["value"] == pytest.approx(composed)
    assert composed > trainer.ledger.epsilon()  # the audit run is composed in


def test_audit_entry_keeps_its_lower_bound_label():
    report = {
        "guarantee": "formal",
        "epsilon": 2.0,
        "delta": 1e-5,
        "accountant": "prv",
        "dataset_size": 10,
        "mechanisms": [],
    }
    block = privacy_metadata(
        report, "dp-sgd", audit={"kind": "guarantee", "epsilon_lower_bound": 0.1, "audit_data": "public"}
    )
    assert block["audit"]["kind"] == "empirical lower bound (not the guarantee)" and block["epsilon"] == 2.0


def test_card_refuses_a_private_audit_missing_from_epsilon():
    report = {
        "guarantee": "formal",
        "epsilon": 2.0,
        "delta": 1e-5,
        "accountant": "prv",
        "dataset_size": 10,
        "mechanisms": [],
    }
    for entry in ({"epsilon_lower_bound": 0.1}, {"epsilon_lower_bound": 0.1, "audit_data": "private"}):
        with pytest.raises(ValueError, match="attach_audit"):
            privacy_metadata(report, "dp-sgd", audit=entry)


# ---------------------------------------------------------------- an audit is not a free second look at the data
TRAIN_EPSILON = 3.0


def _tiny_audit(output_dir, audit_data: str, dataset=None) -> AuditResult:
    """A formal (secret-noise) audit, small and fast: 10 canaries, 3 steps."""
    tok = tiny.tokenizer()
    return run_audit(
        tiny.bert,
        dataset if dataset is not None else tiny.sentiment_dataset(64, seed=1),
        DPConfig(noise_multiplier=1.0, max_grad_norm=1.0),
        training_args(output_dir, max_steps=3, per_device_train_batch_size=16),
        canaries=10,
        k_plus=2,
        seed=0,
        audit_data=audit_data,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
    )


def _trained(output_dir):
    trainer = make_trainer(output_dir, dp=DPConfig(target_epsilon=TRAIN_EPSILON), max_steps=3)
    trainer.train()
    return trainer


def _card_privacy(trainer) -> tuple[dict, str]:
    trainer.save_model()
    card = ModelCard.load(os.path.join(trainer.args.output_dir, "README.md"))
    return card.data.to_dict()["privacy"], card.text


def test_audit_on_the_training_data_is_composed_into_epsilon(tmp_path, caplog):
    trainer = _trained(tmp_path / "run")
    training_epsilon = trainer.privacy_report()["epsilon"]
    result = _tiny_audit(tmp_path / "audit", "private", dataset=trainer.train_dataset)
    assert result.audit_data == "private" and result.guarantee == "formal"
    assert [g.name for g in result.mechanisms] == ["dp-sgd"] and result.mechanisms[0].steps == 3
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        trainer.attach_audit(result)
        trainer.attach_audit(result)  # idempotent: the same run is counted once
    audit_groups = [dataclasses.replace(g, name=f"audit:{g.name}") for g in result.mechanisms]
    expected = compute_epsilon([*trainer.ledger.mechanisms, *audit_groups], trainer.delta, "prv")
    report = trainer.privacy_report()
    assert report["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert report["epsilon"] > training_epsilon and report["training_epsilon"] == training_epsilon
    assert [m["name"] for m in report["mechanisms"]] == ["dp-sgd", "audit:dp-sgd"]
    assert "exceeds the target" in caplog.text and caplog.text.count("exceeds the target") == 1
    assert trainer.ledger.epsilon() == training_epsilon, "the training ledger (saved in checkpoints) is untouched"

    privacy, text = _card_privacy(trainer)
    _card_privacy(trainer)  # saving again changes nothing
    assert privacy["epsilon"] == pytest.approx(report["epsilon"]) and privacy["guarantee"] == "formal"
    recomputed = compute_epsilon([MechanismGroup.from_dict(m) for m in privacy["mechanisms"]], privacy["delta"], "prv")
    assert recomputed == pytest.approx(privacy["epsilon"], rel=1e-9)
    assert privacy["audit"]["audit_data"] == "private" and "includes the empirical audit" in text
    assert "composed into the ε above" in text
    assert PrivacyLedger.load(tmp_path / "run" / "privacy_ledger.json").epsilon() == training_epsilon


def test_declared_disjoint_audit_leaves_epsilon_unchanged_and_the_card_says_so(tmp_path):
    trainer = _trained(tmp_path / "run")
    training_epsilon = trainer.privacy_report()["epsilon"]
    trainer.attach_audit(_tiny_audit(tmp_path / "audit", "disjoint"))
    report = trainer.privacy_report()
    assert report["epsilon"] == training_epsilon and "training_epsilon" not in report
    assert [m["name"] for m in report["mechanisms"]] == ["dp-sgd"]
    privacy, text = _card_privacy(trainer)
    assert privacy["epsilon"] == training_epsilon and privacy["audit"]["audit_data"] == "disjoint"
    assert "audit run on data declared disjoint from the training data by the caller" in text
    assert "includes the empirical audit" not in text


def test_audit_cannot_reach_the_card_without_its_composition(tmp_path, dpsgd_audit):
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(TypeError, match="AuditResult"):
        trainer.audit = dpsgd_audit.card_entry()  # the old way: a card entry alone, ε untouched
    declared = dataclasses.replace(
        dpsgd_audit, audit_data="disjoint", dataset_fingerprint=trainer.train_dataset._fingerprint
    )
    with pytest.raises(ValueError, match="same fingerprint"):
        trainer.attach_audit(declared)
    with pytest.raises(ValueError, match="audit_data"):
        run_audit(tiny.bert, tiny.sentiment_dataset(8), DPConfig(noise_multiplier=1.0), None, audit_data="held-out")


def test_canaries_refuse_columns_they_cannot_fill():
    with pytest.raises(ValueError, match="'sentence'"):
        build_canaries({"input_ids": [2, 5], "sentence": "a b"}, [70], 4, 2, random.Random(0))


def test_command_line_demo_writes_the_result(tmp_path, capsys):
    output, ledger = tmp_path / "audit.json", PrivacyLedger(1000, 1e-5)
    ledger.record("dp-sgd", 1.0, 0.05, 1.0, steps=50)
    ledger.save(tmp_path / "ledger.json")
    status = main(
        [
            "--demo_size",
            "200",
            "--canaries",
            "40",
            "--epochs",
            "1",
            "--batch_size",
            "20",
            "--seed",
            "0",
            "--output_dir",
            str(tmp_path / "run"),
            "--output",
            str(output),
            "--ledger",
            str(tmp_path / "ledger.json"),
        ]
    )
    result = json.loads(output.read_text())
    assert status == 0 and result["refutes_claim"] is False
    assert result["canaries"] == 40 and result["k_plus"] == 8 and result["claimed_epsilon"] <= 2.0
    assert set(result["ceiling"]) == {"epsilon", "mu", "gdp_epsilon"} and result["ceiling"]["epsilon"] > 0
    assert all({"mu_lower_bound", "gdp_epsilon_lower_bound"} <= set(b) for b in result["bounds"])
    assert result["audit_data"] == "private" and "composed" in result["declaration"]
    assert result["composed"]["training_epsilon"] == ledger.epsilon() < result["composed"]["epsilon"]
    out = capsys.readouterr().out
    assert "This is an audit run on the training data" in out
    assert f"Composed guarantee of the released model: ε = {result['composed']['epsilon']:.4g}" in out
    assert json.dumps(result, indent=2) in out
    summary, verdict = out.rstrip().splitlines()[-2:]  # after the JSON, in words
    assert summary.startswith("Canaries: 40 token canaries") and f"{result['included']} of 40 included" in summary
    assert verdict.startswith("Verdict: no refutation. ε_lb = ")
    assert f"The largest ε this audit could have refuted is {result['ceiling']['epsilon']:.3g}" in verdict


def _result(lower: float, claimed: float, ceiling: float, claim: str = "epsilon") -> AuditResult:
    return AuditResult(
        epsilon_lower_bound=lower,
        confidence=0.95,
        claimed_epsilon=claimed,
        delta=DELTA,
        method="dp-sgd",
        canaries=1000,
        included=1002,
        k_plus=200,
        k_minus=0,
        bounds=(),
        date="today",
        audit_data="private",
        mechanisms=(),
        accountant="prv",
        guarantee="formal" if claim == "epsilon" else "none",
        dataset_fingerprint=None,
        claim=claim,
        ceiling=AuditCeiling(ceiling, 1.0, ceiling),
        canary_sets=("token", "gradient"),
    )


def test_the_verdict_says_what_the_audit_showed_and_what_it_could_have():
    assert _result(0.0, 2.0, 3.95).verdict() == (
        "Verdict: no refutation. ε_lb = 0 at 95% confidence against the claimed ε = 2: the audit found no evidence "
        "against it; a lower bound, not a measure of privacy. A bound of 0 means the guesses were no better than "
        "chance explains. The largest ε this audit could have refuted is 3.95 (every guess right with 1,000 canaries "
        "and 200 guesses)."
    )
    assert (
        _result(0.5, 8.0, 3.95)
        .verdict()
        .endswith(
            "The largest ε this audit could have refuted is 3.95 (every guess right with 1,000 canaries and 200 "
            "guesses), below 8: no outcome of it could have refuted the claim."
        )
    )
    assert "bound of 0" not in _result(0.5, 8.0, 3.95).verdict()
    assert _result(3.27, 2.0, 3.95).verdict() == (
        "Verdict: REFUTED. ε_lb = 3.27 at 95% confidence against the claimed ε = 2: more canaries were guessed right "
        "than a run with that privacy allows, except with probability 5%; the training or its accounting is broken."
    )
    no_guarantee = _result(3.27, 2.0, 3.95, claim="clt_epsilon").verdict()
    assert "the tested figure clt_epsilon (not a guarantee) = 2" in no_guarantee and "claimed ε" not in no_guarantee
    assert _result(0.0, 2.0, 3.95).canary_summary().endswith("1,002 of 2,000 included.")


def test_the_command_line_chooses_the_head_as_sentence_classifier_does(tmp_path):
    from transformers import BertConfig, BertModel

    from hf_private.cli.audit import _parser, _task_from_files
    from hf_private.models.heads import MeanPooledBertForSequenceClassification

    checkpoint = tmp_path / "mean-pooling"
    BertModel(
        BertConfig(
            vocab_size=tiny.VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).save_pretrained(checkpoint)
    tiny.tokenizer().save_pretrained(checkpoint)
    (checkpoint / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (checkpoint / "1_Pooling").mkdir()
    (checkpoint / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    train = tmp_path / "train.csv"
    train.write_text("sentence,label\ngood film,1\nbad film,0\n")
    common = ["--model_name_or_path", str(checkpoint), "--train_file", str(train)]
    heads = {
        head: type(_task_from_files(_parser().parse_args([*common, *flag]))[0]())
        for head, flag in (("auto", []), ("cls", ["--head", "cls"]), ("mean", ["--head", "mean"]))
    }
    assert heads["auto"] is heads["mean"] is MeanPooledBertForSequenceClassification
    assert heads["cls"].__name__ == "BertForSequenceClassification"


def test_command_line_entry_point_is_declared():
    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["hf-private-audit"] == "hf_private.cli.audit:main"


def test_python_dash_m_runs_without_runtime_warning():
    """`import hf_private` imports the audit package and its cli the trainer; running either as a script would load
    it twice, so `python -m hf_private.audit` runs the package's __main__."""
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "hf_private.audit", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: hf-private-audit" in done.stdout


# ---------------------------------------------------------------- at user level: every canary a user of its own
def _user_level_audit(output_dir, seed: int = 0) -> AuditResult:
    dp = DPConfig(
        target_epsilon=CLAIMED_EPSILON,
        target_delta=DELTA,
        max_grad_norm=CLIP,
        noise_seed=1000 + seed,
        privacy_unit="user",
        user_column="user_id",
        examples_per_user=4,
    )
    tok = tiny.tokenizer()
    data = tiny.sentiment_dataset(400, seed=1)
    data = data.add_column("user_id", [i // 4 for i in range(len(data))])  # 100 users of 4 examples
    return run_audit(
        tiny.bert,
        data,
        dp,
        training_args(output_dir, **AUDIT_ARGS),
        canaries=CANARIES,
        k_plus=K_PLUS,
        seed=seed,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
    )


def test_user_level_dp_sgd_passes_the_audit_and_an_unnoised_one_fails(tmp_path, monkeypatch):
    result = _user_level_audit(tmp_path / "sound")
    assert result.epsilon_lower_bound < CLAIMED_EPSILON and not result.refutes_claim
    BUGS["noise-not-added"](monkeypatch)
    broken = _user_level_audit(tmp_path / "broken")
    assert broken.epsilon_lower_bound > CLAIMED_EPSILON and broken.refutes_claim, broken.bounds
