"""User-level DP by example-level sampling (ELS): the ledger event, its accounting, calibration and plans.

ELS (Charles et al. 2024): every user keeps at most k examples, examples are Poisson-sampled at q, clipped to C,
noised with σ·C. One user moves the sum by J·C, J ~ Binomial(k, q): per release the mixture of Gaussians
N(0, σ²) vs Σ_j Binom(k, q)[j]·N(j, σ²). The setting of the figures below: σ = 1, q = 0.01, 1000 steps, δ = 1e-5.
"""

import json
import math
import re

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

from hf_private.privacy import (
    ELS_POISSON_GAUSSIAN,
    POISSON_GAUSSIAN,
    BudgetError,
    MechanismGroup,
    PrivacyLedger,
    PrivacyPlan,
    Stage,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from hf_private.privacy.accountants import epsilon_bound, sampler_tail_delta
from hf_private.privacy.accountants.pld import pld_epsilon
from hf_private.privacy.accountants.rdp import els_fallback, rdp_epsilon
from hf_private.privacy.calibration import max_steps_within
from hf_private.privacy.rng import tail_mass

SIGMA, Q, STEPS, DELTA = 1.0, 0.01, 1000, 1e-5


def els(k, sigma=SIGMA, q=Q, steps=STEPS, name="dp-sgd"):
    return MechanismGroup.els(name, sigma, q, k, steps)


@pytest.fixture(scope="module")
def tight():
    """ε of the ELS releases at σ = 1, q = 0.01, 1000 steps, δ = 1e-5 under "prv" (PLD for k ≥ 2), k → (ε, label)."""
    return {k: epsilon_bound([els(k)], DELTA, "prv") for k in (1, 2, 4, 16)}


def independent_pld(groups, delta, interval=1e-3):
    """ε straight from dp_accounting's PLD accountant, every event built here from its definition."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    for group in groups:
        if group.mechanism == ELS_POISSON_GAUSSIAN:
            k = group.examples_per_user
            probs = [math.comb(k, j) * group.sample_rate**j * (1 - group.sample_rate) ** (k - j) for j in range(k + 1)]
            event = dp_event.MixtureOfGaussiansDpEvent(group.noise_multiplier, list(range(k + 1)), probs)
        else:
            event = dp_event.PoissonSampledDpEvent(group.sample_rate, dp_event.GaussianDpEvent(group.noise_multiplier))
        accountant.compose(dp_event.SelfComposedDpEvent(event, group.steps))
    return accountant.get_epsilon(delta)


# ---------------------------------------------------------------------------------------------- the accounting
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_one_example_per_user_is_plain_dp_sgd(accountant, tight):
    plain = epsilon_bound([MechanismGroup("dp-sgd", SIGMA, Q, STEPS)], DELTA, accountant)
    assert epsilon_bound([els(1)], DELTA, accountant) == plain
    if accountant == "prv":
        assert tight[1] == plain and plain[1] == "prv"
        # The k = 1 mixture, Binom(1, q) = (1 − q, q) on shifts (0, 1), through dp_accounting: PRV's bound (its ε plus
        # its 0.01 discretisation error) within 0.02 above it.
        mixture = independent_pld([els(1)], DELTA - sampler_tail_delta([els(1)], DELTA))
        assert mixture <= plain[0] <= mixture + 0.02


def test_epsilon_grows_with_the_examples_per_user(tight):
    epsilons = [tight[k][0] for k in (1, 2, 4, 16)]
    assert [tight[k][1] for k in (1, 2, 4, 16)] == ["prv", "pld", "pld", "pld"]
    assert all(a < b for a, b in zip(epsilons, epsilons[1:])), epsilons
    assert epsilons[1:] == pytest.approx([3.98, 8.90, 52.72], abs=0.02)  # the figures at σ = 1, q = 0.01
    fallback = [compute_epsilon([els(k)], DELTA, "rdp") for k in (1, 2, 4, 16)]
    assert all(a < b for a, b in zip(fallback, fallback[1:])), fallback


@pytest.mark.parametrize("k", [2, 4, 16])
def test_tight_epsilon_is_the_mixtures_between_its_one_shift_and_its_k_shift_bounds(k, tight):
    """Per release, PSG(σ, q') ≼ mixture ≼ PSG(σ/k, q'), q' = 1 − (1 − q)^k (the shift of a sampled user is between 1
    and k). Both bounds through the same PLD code: a mutation that accounts the mixture with q, or with q' at
    sensitivity 1, or at k·C, lands outside."""
    at = DELTA - sampler_tail_delta([els(k)], DELTA)
    sigma_k, any_sampled = els_fallback(SIGMA, Q, k)
    assert any_sampled == pytest.approx(1 - (1 - Q) ** k, rel=1e-12) and sigma_k == SIGMA / k
    plain_q = pld_epsilon([(SIGMA, Q, 1, STEPS)], at)[0]
    one_shift = pld_epsilon([(SIGMA, any_sampled, 1, STEPS)], at)[0]
    assert plain_q < one_shift < tight[k][0]
    if k <= 4:  # at k = 16 the k-shift bound's loss spans thousands: far above, and slow to discretise finely
        k_shift = pld_epsilon([(sigma_k, any_sampled, 1, STEPS)], at)[0]
        assert tight[k][0] < k_shift


def group_privacy_epsilon(k, sigma, delta):
    """The example-level RDP guarantee (ε₁, δ₁) carried to a group of k examples: (k·ε₁, k·e^{(k−1)ε₁}·δ₁), at the
    largest δ₁ that makes the group's δ at most `delta` (bisection in log δ₁; ε₁ falls as δ₁ grows)."""
    low, high = math.log(delta) - 200, math.log(delta)  # feasible, infeasible
    for _ in range(60):
        middle = (low + high) / 2
        eps = rdp_epsilon([(sigma, Q, STEPS)], math.exp(middle))
        if math.log(k) + (k - 1) * eps + middle <= math.log(delta):
            low = middle
        else:
            high = middle
    return k * rdp_epsilon([(sigma, Q, STEPS)], math.exp(low))


@pytest.mark.parametrize("k", [2, 4])
def test_tight_below_fallback_below_naive_bounds(k):
    """At σ = 2 (the fallback's σ/k stays above the sampler's floor): tight (PLD) ≤ fallback ≤ the unsampled
    Gaussian at sensitivity k·C every step; and tight ≤ group privacy of the example-level guarantee.

    The fallback is *not* below group privacy: here k = 2: tight 1.33, group 1.50, fallback 4.30; k = 4: 2.89,
    3.38, 51.3 (at σ = 1, k = 4: 8.90, 15.9, 382). It charges k·C whenever any of the user's examples is sampled."""
    sigma = 2.0
    tight = compute_epsilon([els(k, sigma=sigma)], DELTA, "prv")
    fallback = compute_epsilon([els(k, sigma=sigma)], DELTA, "rdp")
    sigma_k, any_sampled = els_fallback(sigma, Q, k)
    # "rdp" on an ELS event is exactly RDP on its fallback, at the ELS event's own δ − δ_tail
    at = DELTA - sampler_tail_delta([els(k, sigma=sigma)], DELTA)
    assert fallback == rdp_epsilon([(sigma_k, any_sampled, STEPS)], at)
    unsampled = rdp_epsilon([(sigma_k, 1.0, STEPS)], at)
    group = group_privacy_epsilon(k, sigma, DELTA)
    assert tight < fallback < unsampled
    assert tight < group


def test_tight_epsilon_is_dp_accountings_recomputed_independently():
    """The ledger's ε of an ELS history, and of one mixed with plain DP-SGD releases, against dp_accounting's PLD
    accountant fed the events built from their definitions (binomial pmf by hand) at δ − δ_tail: ours uses a
    coarser grid where a release's loss is wide (an upper bound either way), so it lies within 0.02 above."""
    for history in ([els(4)], [MechanismGroup("psel", 1.5, 0.02, 200), els(4, sigma=1.5, steps=500)]):
        ledger = PrivacyLedger(10_000, DELTA)
        for group in history:
            ledger.record_event(group)
        report = ledger.report()
        expected = independent_pld(history, DELTA - report["sampler_tail_delta"])
        assert report["accountant"] == "pld"
        assert expected - 1e-6 <= report["epsilon"] <= expected + 0.02


def test_sampler_tail_of_an_els_release_averages_over_the_sampled_examples():
    """δ_tail per release is Σ_j Binom(k, q)[j]·tail_mass(σ/j): the worst shift k/σ alone (16 std at k = 16) would
    spend all of δ, the plain tail_mass(σ) would undercount a shift of up to k·C."""
    k = 16
    per_release = sampler_tail_delta([els(k, steps=1)], DELTA)
    probs = stats.binom.pmf(np.arange(k + 1), k, Q)
    by_hand = sum(probs[j] * tail_mass(SIGMA / j) for j in range(1, k + 1))
    assert per_release == pytest.approx(by_hand, rel=1e-6)
    assert tail_mass(SIGMA) < per_release < tail_mass(SIGMA / k) * 1e-6
    assert sampler_tail_delta([els(k)], DELTA) < DELTA / 100  # 1000 releases: a finite ε remains
    assert tail_mass(SIGMA / k) * STEPS > DELTA


# --------------------------------------------------------------------------------------- calibration and plans
@pytest.mark.parametrize("k", [1, 4, 16])
def test_a_plan_with_an_els_stage_calibrates_to_the_target(k):
    target = 8.0
    plan = PrivacyPlan(
        10_000, 100, steps=STEPS, delta=DELTA, target_epsilon=target, stages=[Stage("dp-sgd", examples_per_user=k)]
    )
    (event,) = plan.planned_events()
    assert event.mechanism == ELS_POISSON_GAUSSIAN and event.examples_per_user == k and event.sample_rate == Q
    assert target - 0.01 <= plan.epsilon() <= target
    assert plan.epsilon() == compute_epsilon([event], DELTA, "prv")
    sigma = calibrate_noise_multiplier(target, DELTA, Q, STEPS, examples_per_user=k)
    assert plan["dp-sgd"].noise_multiplier == sigma
    if k == 1:
        assert (
            sigma
            == PrivacyPlan(10_000, 100, steps=STEPS, delta=DELTA, target_epsilon=target)["dp-sgd"].noise_multiplier
        )
    else:  # more examples per user, more noise for the same ε
        assert sigma > calibrate_noise_multiplier(target, DELTA, Q, STEPS)
    released = plan.event("dp-sgd", steps=3, max_grad_norm=1.0)
    assert (released.mechanism, released.examples_per_user, released.steps) == (ELS_POISSON_GAUSSIAN, k, 3)
    assert plan.to_dict()["stages"][0]["mechanism"] == ELS_POISSON_GAUSSIAN
    assert plan.to_dict()["stages"][0]["examples_per_user"] == k
    assert f"at most {k} examples per user" in plan.describe()


def test_rdp_calibration_uses_the_fallback_and_needs_more_noise():
    k, target = 4, 8.0
    sigma_rdp = calibrate_noise_multiplier(target, DELTA, Q, STEPS, accountant="rdp", examples_per_user=k)
    assert target - 0.01 <= compute_epsilon([els(k, sigma=sigma_rdp)], DELTA, "rdp") <= target
    sigma_k, any_sampled = els_fallback(sigma_rdp, Q, k)
    at = DELTA - sampler_tail_delta([els(k, sigma=sigma_rdp)], DELTA)
    assert compute_epsilon([els(k, sigma=sigma_rdp)], DELTA, "rdp") == rdp_epsilon([(sigma_k, any_sampled, STEPS)], at)
    assert sigma_rdp > calibrate_noise_multiplier(target, DELTA, Q, STEPS, examples_per_user=k)


def test_budget_stop_of_an_els_plan():
    k, target = 4, 8.0
    plan = PrivacyPlan(
        10_000, 100, steps=STEPS, delta=DELTA, target_epsilon=target, stages=[Stage("dp-sgd", examples_per_user=k)]
    )
    sigma = plan["dp-sgd"].noise_multiplier
    allowed = plan.max_training_steps()
    assert allowed == max_steps_within(target, DELTA, sigma, Q, examples_per_user=k) >= STEPS
    assert compute_epsilon([els(k, sigma=sigma, steps=allowed)], DELTA, "prv") <= target
    assert compute_epsilon([els(k, sigma=sigma, steps=allowed + 1)], DELTA, "prv") > target
    plain = max_steps_within(target, DELTA, sigma, Q)  # the same σ at example level allows far more
    assert plain > 2 * allowed


def test_an_els_plan_refuses_a_sigma_below_its_sampler_tail_floor():
    """The floor on σ counts the ELS tail (shifts up to k·C): at k = 16, q = 0.01, 1000 steps it is ≈ 0.79."""

    def plan(sigma):
        return PrivacyPlan(
            10_000,
            100,
            steps=STEPS,
            delta=DELTA,
            noise_multiplier=sigma,
            stages=[Stage("dp-sgd", examples_per_user=16)],
        )

    with pytest.raises(BudgetError, match="finite tail") as refused:
        plan(0.3)
    floor = float(re.search(r"every σ ≥ ([0-9.]+)", str(refused.value), re.IGNORECASE).group(1))
    assert 0.5 < floor < 1.0
    plan(floor * 1.001)
    with pytest.raises(BudgetError, match="raise noise_multiplier"):
        plan(floor * 0.99)
    PrivacyPlan(10_000, 100, steps=STEPS, delta=DELTA, noise_multiplier=0.5)  # example level: 0.5 is fine


def test_existing_stages_and_plans_are_unchanged():
    stage = Stage("dp-sgd")
    assert stage.examples_per_user is None
    plan = PrivacyPlan(10_000, 100, steps=STEPS, delta=DELTA, noise_multiplier=SIGMA)
    (event,) = plan.planned_events()
    assert event.mechanism == POISSON_GAUSSIAN and event.examples_per_user is None
    assert "examples_per_user" not in event.to_dict() and "examples_per_user" not in plan.to_dict()["stages"][0]


# ----------------------------------------------------------------------------------------------- the ledger
def test_els_event_validation():
    with pytest.raises(ValueError, match="needs examples_per_user"):
        MechanismGroup("dp-sgd", 1.0, 0.01, 1, mechanism=ELS_POISSON_GAUSSIAN)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="positive integer"):
            MechanismGroup.els("dp-sgd", 1.0, 0.01, bad)
    with pytest.raises(ValueError, match="Only an ELS event"):
        MechanismGroup("dp-sgd", 1.0, 0.01, 1, examples_per_user=4)
    with pytest.raises(ValueError, match="Only an ELS event"):
        MechanismGroup("dp-fp", 0.0, 1.0, 1, mechanism="no_guarantee", reason="raw", examples_per_user=4)
    with pytest.raises(ValueError, match="examples_per_user must be a positive integer"):
        Stage("dp-sgd", examples_per_user=0)
    with pytest.raises(ValueError, match="no ELS accounting"):
        Stage("dp-fp", no_guarantee="paper mode", examples_per_user=2)
    assert not MechanismGroup.els("dp-sgd", 0.0, 0.01, 4).has_guarantee
    assert compute_epsilon([MechanismGroup.els("dp-sgd", 0.0, 0.01, 4)], DELTA, "prv") == math.inf


def test_ledger_round_trips_els_events_through_json(tmp_path):
    ledger = PrivacyLedger(10_000, DELTA)
    ledger.record("psel", 2.0, 0.02, steps=5)
    for _ in range(3):
        ledger.record("dp-sgd", SIGMA, Q, max_grad_norm=1.0, examples_per_user=4)
    ledger.record("dp-sgd", SIGMA, Q, max_grad_norm=1.0, examples_per_user=2)  # another k: another release
    ledger.record("dp-sgd", SIGMA, Q, max_grad_norm=1.0)  # example level: another release too
    assert [(g.name, g.mechanism, g.examples_per_user, g.steps) for g in ledger.mechanisms] == [
        ("psel", POISSON_GAUSSIAN, None, 5),
        ("dp-sgd", ELS_POISSON_GAUSSIAN, 4, 3),
        ("dp-sgd", ELS_POISSON_GAUSSIAN, 2, 1),
        ("dp-sgd", POISSON_GAUSSIAN, None, 1),
    ]
    event = ledger.mechanisms[1]
    assert event.to_dict() == {
        "name": "dp-sgd",
        "noise_multiplier": SIGMA,
        "sample_rate": Q,
        "steps": 3,
        "max_grad_norm": 1.0,
        "mechanism": ELS_POISSON_GAUSSIAN,
        "examples_per_user": 4,
    }
    assert MechanismGroup.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    path = tmp_path / "ledger.json"
    ledger.save(path)
    state = json.loads(path.read_text())
    assert state["format_version"] == 2
    assert [m.get("examples_per_user") for m in state["mechanisms"]] == [None, 4, 2, None]
    loaded = PrivacyLedger.load(path)
    assert loaded.mechanisms == ledger.mechanisms
    assert loaded.report() == ledger.report()
    assert loaded.epsilon() == compute_epsilon(ledger.mechanisms, DELTA, "prv")
    assert loaded.report()["accountant"] == "pld"
    assert loaded.epsilon() > compute_epsilon(
        [MechanismGroup(g.name, g.noise_multiplier, g.sample_rate, g.steps) for g in ledger.mechanisms], DELTA, "prv"
    )


def test_a_resumed_ledger_keeps_the_els_event_and_continues_it(tmp_path):
    plan = PrivacyPlan(
        10_000, 100, steps=200, delta=DELTA, noise_multiplier=SIGMA, stages=[Stage("dp-sgd", examples_per_user=4)]
    )
    ledger = PrivacyLedger(10_000, DELTA)
    for _ in range(120):
        ledger.record_event(plan.event("dp-sgd", max_grad_norm=1.0))
    path = tmp_path / "ledger.json"
    ledger.save(path)
    resumed = PrivacyLedger(10_000, DELTA)
    resumed.load_state_dict(json.loads(path.read_text()))
    assert resumed.mechanisms == [MechanismGroup.els("dp-sgd", SIGMA, Q, 4, 120, 1.0)]
    for _ in range(80):
        resumed.record_event(plan.event("dp-sgd", max_grad_norm=1.0))
    assert resumed.mechanisms == [MechanismGroup.els("dp-sgd", SIGMA, Q, 4, 200, 1.0)]
    assert resumed.epsilon() == plan.epsilon()
    assert resumed.epsilon_if("dp-sgd", SIGMA, Q, 1.0, steps=10, examples_per_user=4) > resumed.epsilon()


def test_old_ledgers_still_load_as_example_level():
    state = {
        "format_version": 2,
        "dataset_size": 10_000,
        "delta": DELTA,
        "accountant": "rdp",
        "mechanisms": [
            {
                "name": "dp-sgd",
                "noise_multiplier": 1.0,
                "sample_rate": 0.01,
                "steps": 7,
                "max_grad_norm": 1.0,
                "mechanism": "poisson_gaussian",
            }
        ],
    }
    ledger = PrivacyLedger(10_000, DELTA, "rdp")
    ledger.load_state_dict(state)
    assert ledger.mechanisms == [MechanismGroup("dp-sgd", 1.0, 0.01, 7, 1.0)]
    assert ledger.state_dict() == state


def test_audit_composition_rebuilds_els_events_by_name():
    """Reports composed with audits (hf_private.audit.result) cache ε on the serialised events: an ELS event must come
    back as itself (a positional rebuild would read k as a no-guarantee reason)."""
    from hf_private.audit.result import _composed_bound

    groups = [MechanismGroup("psel", 2.0, 0.02, 5), els(4, steps=100)]
    key = tuple(tuple(g.to_dict().items()) for g in groups)
    assert _composed_bound(key, DELTA, "prv") == epsilon_bound(groups, DELTA, "prv")
    assert _composed_bound(key, DELTA, "prv")[1] == "pld"
