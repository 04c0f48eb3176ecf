"""Accountants and calibration against the reference tables (methods_spec §3.7) and opacus itself."""

import logging
import math
from dataclasses import replace

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size
from opacus.accountants.utils import get_noise_multiplier

import hf_private.privacy.accountants as accountants
import hf_private.privacy.calibration as calibration
from hf_private.privacy import (
    BudgetError,
    MechanismGroup,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    max_steps_within,
)
from hf_private.privacy.accountants import prv, rdp


def _eps(sigma, q, steps, delta, accountant, prior=()):
    return compute_epsilon([*prior, MechanismGroup("dp-sgd", sigma, q, steps)], delta, accountant)


# methods_spec §3.7 (RDP, opacus orders and conversion, q = B/N, T = ⌊E/q⌋).
SST2 = dict(delta=1 / (2 * 67_349), sample_rate=1000 / 67_349, steps=202)
QNLI = dict(delta=1 / (2 * 104_743), sample_rate=2000 / 104_743, steps=314)
CIFAR3 = dict(delta=1e-5, sample_rate=1000 / 50_000, steps=150)
REFERENCE = [
    (SST2, 3.0, 0.822),
    (SST2, 8.0, 0.579),
    (QNLI, 3.0, 0.946),
    (QNLI, 8.0, 0.652),
    (CIFAR3, 1.0, 1.392),
    (CIFAR3, 2.0, 1.011),
    (CIFAR3, 4.0, 0.771),
    (CIFAR3, 8.0, 0.598),
]


@pytest.mark.parametrize(("setting", "target", "reference"), REFERENCE)
def test_rdp_calibration_matches_reference_table(setting, target, reference):
    sigma = calibrate_noise_multiplier(target, accountant="rdp", **setting)
    # Measured differences are at most 0.0008: the table is rounded to 3 decimals and the search stops
    # anywhere in the tolerance band.
    assert sigma == pytest.approx(reference, abs=0.002)
    eps = _eps(sigma, setting["sample_rate"], setting["steps"], setting["delta"], "rdp")
    assert eps <= target
    assert target - eps <= 0.01


@pytest.mark.filterwarnings("ignore:Optimal order")
def test_rdp_calibration_is_opacus_get_noise_multiplier():
    ours = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 3000, accountant="rdp")
    theirs = get_noise_multiplier(target_epsilon=3, target_delta=1e-5, sample_rate=0.01, steps=3000, accountant="rdp")
    assert ours == theirs  # the same bisection (Appendix A) on the same accountant
    assert ours == pytest.approx(1.0864, abs=5e-4)  # hf_conventions.md §5


def test_prv_calibration_is_tighter_and_within_tolerance(monkeypatch):
    counted = []

    def counting(mechanisms, delta, accountant):
        counted.append(accountant)
        return compute_epsilon(mechanisms, delta, accountant)

    monkeypatch.setattr(calibration, "compute_epsilon", counting)
    sigma_prv = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, accountant="prv")
    monkeypatch.undo()
    sigma_rdp = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, accountant="rdp")
    assert sigma_prv < sigma_rdp
    eps = _eps(sigma_prv, 0.01, 1000, 1e-5, "prv")
    assert 3.0 - 0.01 <= eps <= 3.0
    # PRV evaluations are the expensive ones: the RDP answer seeds a few secant steps.
    assert counted.count("prv") <= 5


def test_calibration_with_prior_respects_total_budget():
    prior = [MechanismGroup("dp-sgd", 1.0, 0.01, 200)]
    sigma = calibrate_noise_multiplier(2.0, 1e-5, 0.02, 5, accountant="prv", prior=prior, name="psel")
    eps = _eps(sigma, 0.02, 5, 1e-5, "prv", prior)
    assert 2.0 - 0.01 <= eps <= 2.0


def test_compute_epsilon_equals_opacus_stepped_by_hand():
    groups = [MechanismGroup("dp-sgd", 1.1, 0.01, 120), MechanismGroup("psel", 2.5, 0.05, 7)]
    for accountant, cls in (("rdp", RDPAccountant), ("prv", PRVAccountant)):
        reference = cls()
        for group in groups:
            for _ in range(group.steps):
                reference.step(noise_multiplier=group.noise_multiplier, sample_rate=group.sample_rate)
        at = 1e-5 - accountants.sampler_tail_delta(groups, 1e-5)  # what the sampler's finite tail leaves
        assert compute_epsilon(groups, 1e-5, accountant) == pytest.approx(reference.get_epsilon(at), rel=1e-9)


# (σ, q, steps) histories: one mechanism, small σ, one step, and heterogeneous ones (two (σ, q) groups).
HISTORIES = [
    [(1.0, 0.01, 1000)],
    [(0.515, 0.0128, 234)],
    [(2.0, 0.1, 1)],
    [(1.1, 0.01, 120), (2.5, 0.05, 7)],
    [(0.8, 0.02, 300), (3.0, 0.001, 5)],
]


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("history", HISTORIES)
def test_cached_accounting_equals_opacus(history):
    """The cached RDP curves and our PRV domain rule give opacus' own numbers (same grid, same ε)."""
    delta = 1e-5
    groups = [MechanismGroup("dp-sgd", sigma, q, steps) for sigma, q, steps in history]
    at = delta - accountants.sampler_tail_delta(groups, delta)  # the accountant's δ: the sampler tail taken out
    opacus_rdp, opacus_prv = RDPAccountant(), PRVAccountant()
    opacus_rdp.history, opacus_prv.history = list(history), list(history)
    assert compute_epsilon(groups, delta, "rdp") == pytest.approx(opacus_rdp.get_epsilon(at), rel=1e-12, abs=0)
    reference = opacus_prv.get_epsilon(at, eps_error=0.01, delta_error=at / 1000)
    assert compute_epsilon(groups, delta, "prv") == pytest.approx(reference, rel=1e-12, abs=0)
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    steps = [k for _, _, k in history]
    assert prv._safe_domain_half_width(history, 0.01, delta / 1000) == pytest.approx(
        compute_safe_domain_size(prvs, steps, 0.01, delta / 1000), rel=1e-12, abs=0
    )


def test_rdp_curves_are_computed_once_per_mechanism(monkeypatch):
    """RDP over ~150 orders was ~80% of a PRV evaluation (opacus' domain rule runs it twice): now once per (σ, q)."""
    computed = []
    compute_rdp = rdp_analysis._compute_rdp

    def counting(q, sigma, order):
        computed.append((sigma, q))
        return compute_rdp(q, sigma, order)

    monkeypatch.setattr(rdp_analysis, "_compute_rdp", counting)
    rdp.rdp_per_step.cache_clear()
    groups = [MechanismGroup("dp-sgd", 0.9, 0.013, 50), MechanismGroup("psel", 2.7, 0.03, 3)]
    first = compute_epsilon(groups, 1e-5, "prv")
    assert set(computed) == {(0.9, 0.013), (2.7, 0.03)}
    assert len(computed) == 2 * len(RDPAccountant.DEFAULT_ALPHAS)
    computed.clear()
    for steps in (50, 51, 80):  # more steps of the same mechanisms, as training proceeds: no RDP recomputed
        assert compute_epsilon([replace(groups[0], steps=steps), groups[1]], 1e-5, "prv") >= first
        compute_epsilon([replace(groups[0], steps=steps), groups[1]], 1e-5, "rdp")
    assert computed == []


def test_compute_epsilon_edge_cases():
    assert compute_epsilon([], 1e-5, "prv") == 0.0
    assert compute_epsilon([MechanismGroup("dp-sgd", 0.0, 0.01, 1)], 1e-5, "rdp") == math.inf
    assert compute_epsilon([MechanismGroup("dp-sgd", 0.0, 0.01, 1)], 1e-5, "prv") == math.inf
    # Groups without steps cost nothing; equal (σ, q) anywhere in the history compose as one group.
    assert compute_epsilon([MechanismGroup("dp-sgd", 0.0, 0.01, 0)], 1e-5, "prv") == 0.0
    split = [MechanismGroup("a", 1.0, 0.01, 50), MechanismGroup("b", 2.0, 0.1, 3), MechanismGroup("a", 1.0, 0.01, 50)]
    merged = [MechanismGroup("a", 1.0, 0.01, 100), MechanismGroup("b", 2.0, 0.1, 3)]
    assert compute_epsilon(split, 1e-5, "prv") == compute_epsilon(merged, 1e-5, "prv")
    with pytest.raises(ValueError, match="prv, rdp"):
        compute_epsilon([], 1e-5, "gdp")


def test_prv_reports_the_upper_bound_not_the_estimate():
    """opacus' PRV yields (lower, estimate, upper); the guarantee must be the upper end."""
    history = [(1.0, 0.01, 1000)]
    reference = PRVAccountant()
    reference.history = history
    at = 1e-5 - accountants.sampler_tail_delta([MechanismGroup("dp-sgd", 1.0, 0.01, 1000)], 1e-5)
    dprv = reference._get_dprv(eps_error=0.01, delta_error=at / 1000)
    lower, estimate, upper = dprv.compute_epsilon(at, at / 1000, 0.01)
    ours = _eps(1.0, 0.01, 1000, 1e-5, "prv")
    assert ours == pytest.approx(upper, rel=1e-12)
    assert lower < estimate < ours < _eps(1.0, 0.01, 1000, 1e-5, "rdp")


def test_prv_falls_back_to_rdp_when_its_grid_explodes(caplog):
    # σ=0.5, q=0.3, 1000 steps: opacus' PRV would discretise on ~1.1e7 points, past the cap (at σ=0.1, q=0.01 it
    # would be ~2e8: minutes, gigabytes; the sampler's finite tail now makes ε infinite there).
    assert prv._prv_grid_size([(0.5, 0.3, 1000)], 1e-5) > prv._PRV_MAX_GRID
    with caplog.at_level(logging.INFO, logger="transformers.hf_private.privacy.accountants.prv"):
        eps = _eps(0.5, 0.3, 1000, 1e-5, "prv")
    assert eps == _eps(0.5, 0.3, 1000, 1e-5, "rdp")
    assert "RDP bound" in caplog.text


def test_report_names_the_accountant_that_produced_epsilon():
    """A card must not say PRV when RDP stood in: ε is recomputed from the card with the named accountant."""
    ledger = PrivacyLedger(dataset_size=10_000, delta=1e-5, accountant="prv")
    ledger.record("dp-sgd", noise_multiplier=1.0, sample_rate=0.01, steps=100)
    assert ledger.report()["accountant"] == "prv"
    ledger.record("dp-sgd", noise_multiplier=0.5, sample_rate=0.3, steps=1000)  # PRV's grid explodes
    report = ledger.report()
    assert report["accountant"] == "rdp"
    mechanisms = [MechanismGroup.from_dict(group) for group in report["mechanisms"]]
    assert report["epsilon"] == compute_epsilon(mechanisms, report["delta"], "rdp")
    assert ledger.state_dict()["accountant"] == "prv"  # the configured accountant still governs resume checks


def test_max_steps_within_brackets_the_budget():
    for accountant in ("rdp", "prv"):
        k = max_steps_within(2.0, 1e-5, 1.0, 0.01, accountant=accountant)
        assert _eps(1.0, 0.01, k, 1e-5, accountant) <= 2.0 < _eps(1.0, 0.01, k + 1, 1e-5, accountant)
    prior = [MechanismGroup("psel", 3.0, 0.02, 5)]
    k = max_steps_within(1.0, 1e-5, 1.5, 0.02, accountant="prv", prior=prior)
    assert _eps(1.5, 0.02, k, 1e-5, "prv", prior) <= 1.0 < _eps(1.5, 0.02, k + 1, 1e-5, "prv", prior)


def test_max_steps_within_after_calibration_covers_the_plan():
    sigma = calibrate_noise_multiplier(4.0, 1e-5, 0.01, 400, accountant="prv")
    assert max_steps_within(4.0, 1e-5, sigma, 0.01, accountant="prv") >= 400


def test_max_steps_within_limits():
    assert max_steps_within(3.0, 1e-5, 0.0, 0.01, accountant="rdp") == 0
    assert max_steps_within(3.0, 1e-5, 50.0, 0.01, accountant="rdp", upper=100) == 100
    with pytest.raises(BudgetError, match="already recorded"):
        max_steps_within(0.5, 1e-5, 1.0, 0.01, prior=[MechanismGroup("dp-sgd", 1.0, 0.01, 1000)])


def test_budget_errors_say_what_to_change():
    prior = [MechanismGroup("dp-sgd", 0.8, 0.01, 1000)]
    with pytest.raises(BudgetError, match="already recorded"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 10, prior=prior)
    with pytest.raises(BudgetError, match="fewer steps"):
        calibrate_noise_multiplier(0.5, 1e-5, 0.1, 100, accountant="rdp", max_noise_multiplier=2.0)
    with pytest.raises(BudgetError, match="fewer steps"):
        calibrate_noise_multiplier(0.5, 1e-5, 0.1, 100, accountant="prv", max_noise_multiplier=2.0)
    assert issubclass(BudgetError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(target_epsilon=0.0), "target_epsilon"),
        (dict(target_epsilon=-1.0), "target_epsilon"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(steps=0), "steps"),
        (dict(delta=1.0), "delta"),
        (dict(accountant="gdp"), "prv, rdp"),
    ],
)
def test_calibration_validates_inputs(kwargs, message):
    arguments = dict(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=100) | kwargs
    with pytest.raises(ValueError, match=message):
        calibrate_noise_multiplier(**arguments)
