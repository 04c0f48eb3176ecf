"""The privacy plan: q, steps, δ, the stage schedule, and the noise of every stage calibrated jointly against one target
(methods_spec §2.7 and §2.12 for DP-FROST, §3.4 for X+BiTFiT)."""

import json
import math
import re

import pytest

import hf_private.privacy.accountants as accountants
from hf_private.privacy import (
    NO_GUARANTEE,
    BudgetError,
    JointMechanism,
    MechanismGroup,
    PrivacyLedger,
    PrivacyPlan,
    Stage,
    calibrate_jointly,
    calibrate_noise_multiplier,
    compute_epsilon,
    max_steps_within,
    resolve_delta,
)
from hf_private.privacy.accountants.rdp import rdp_epsilon
from hf_private.privacy.plan import steps_per_epoch

N = 2_000
BATCH = 40  # q = 0.02, 50 steps per epoch
Q = BATCH / N


def _plan(**kwargs):
    arguments = dict(dataset_size=N, expected_batch_size=BATCH, epochs=3, target_epsilon=3.0) | kwargs
    return PrivacyPlan(**arguments)


# ---------------------------------------------------------------------- today's numbers, exactly
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_one_stage_gives_exactly_todays_sigma(accountant):
    plan = _plan(accountant=accountant)
    # What PrivateTrainer.__init__ computes today: q = B/N, ⌈E · round(1/q)⌉ steps, δ = 1/(2N), one calibration.
    assert plan.sample_rate == Q and plan.planned_steps == math.ceil(3 * round(1 / Q)) == 150
    assert plan.delta == 1 / (2 * N)
    today = calibrate_noise_multiplier(3.0, 1 / (2 * N), Q, 150, accountant=accountant)
    (stage,) = plan.planned
    assert (stage.name, stage.steps, stage.start_step, stage.sample_rate) == ("dp-sgd", 150, 0, Q)
    assert stage.noise_multiplier == pytest.approx(today, rel=0, abs=1e-12)
    assert 3.0 - 0.01 <= plan.epsilon() <= 3.0


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_x_plus_bitfit_shares_one_sigma_and_gives_todays(accountant):
    """Two stages, same q and σ (methods_spec §3.4): σ is the one-stage σ for all planned steps."""
    stages = [Stage("dp-sgd-full", epochs=1.0), Stage("dp-bitfit")]
    plan = _plan(accountant=accountant, stages=stages)
    today = calibrate_noise_multiplier(3.0, 1 / (2 * N), Q, 150, accountant=accountant)
    full, bitfit = plan.planned
    assert (full.steps, full.start_step, bitfit.steps, bitfit.start_step) == (50, 0, 100, 50)
    assert full.noise_multiplier == bitfit.noise_multiplier
    assert full.noise_multiplier == pytest.approx(today, rel=0, abs=1e-12)
    assert plan.start_steps == {"dp-sgd-full": 0, "dp-bitfit": 50}


def test_a_first_stage_longer_than_the_plan_leaves_the_last_with_no_steps():
    plan = _plan(accountant="rdp", stages=[Stage("dp-sgd-full", epochs=5.0), Stage("dp-bitfit")])
    assert [(p.steps, p.start_step) for p in plan.planned] == [(150, 0), (0, 150)]
    assert plan["dp-bitfit"].noise_multiplier == plan["dp-sgd-full"].noise_multiplier  # the joint scale
    assert plan.stage_at(149).name == "dp-sgd-full" and plan.stage_at(150).name == "dp-bitfit"


def test_three_training_stages_start_where_the_previous_ends():
    """Start steps are cumulative (the trainer's phase switch at round(epochs_i · steps per epoch) is not)."""
    stages = [Stage("a", epochs=1.0), Stage("b", steps=30), Stage("c", epochs=0.5), Stage("d")]
    plan = _plan(noise_multiplier=1.0, target_epsilon=None, stages=stages)
    assert plan.start_steps == {"a": 0, "b": 50, "c": 80, "d": 105}
    assert [p.steps for p in plan.planned] == [50, 30, 25, 45]
    assert [plan.stage_at(t).name for t in (0, 49, 50, 79, 80, 104, 105, 149, 150, 10_000)] == [
        "a",
        "a",
        "b",
        "b",
        "c",
        "c",
        "d",
        "d",
        "d",
        "d",
    ]


def test_calibration_helper_is_the_one_stage_calibration():
    """calibrate_noise_multiplier is calibrate_jointly with one mechanism of ratio 1 (same evaluations)."""
    one = calibrate_jointly(2.0, 1e-5, [JointMechanism("dp-sgd", 1.0, 0.01, 500)], accountant="prv")
    assert one == calibrate_noise_multiplier(2.0, 1e-5, 0.01, 500, accountant="prv")
    split = [JointMechanism("a", 1.0, 0.01, 200), JointMechanism("b", 1.0, 0.01, 300)]
    assert calibrate_jointly(2.0, 1e-5, split, accountant="prv") == one  # the same composition


# ---------------------------------------------------------------------- joint calibration
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_joint_calibration_scales_every_ratio_stage_by_one_scalar(accountant):
    stages = [Stage("select", sample_rate=0.05, steps=8, training=False, noise_ratio=2.0), Stage("dp-sgd")]
    plan = _plan(accountant=accountant, stages=stages)
    select, sgd = plan["select"], plan["dp-sgd"]
    assert select.noise_multiplier == 2.0 * sgd.noise_multiplier == 2.0 * plan.scale
    events = [
        MechanismGroup("select", select.noise_multiplier, 0.05, 8),
        MechanismGroup("dp-sgd", sgd.noise_multiplier, Q, 150),
    ]
    eps = compute_epsilon(events, plan.delta, accountant)
    assert eps == plan.epsilon() and 3.0 - 0.01 <= eps <= 3.0  # the composition of all stages, never above
    alone = calibrate_noise_multiplier(3.0, plan.delta, Q, 150, accountant=accountant)
    assert sgd.noise_multiplier > alone  # the selection stage costs budget


def test_fixed_stages_count_against_the_target():
    fixed = Stage("audit-like", sample_rate=0.1, steps=20, training=False, noise_multiplier=3.0)
    plan = _plan(accountant="rdp", stages=[fixed, Stage("dp-sgd")])
    assert plan["audit-like"].noise_multiplier == 3.0
    prior = [MechanismGroup("audit-like", 3.0, 0.1, 20)]
    assert plan["dp-sgd"].noise_multiplier == calibrate_noise_multiplier(
        3.0, plan.delta, Q, 150, accountant="rdp", prior=prior
    )
    assert plan.epsilon() <= 3.0
    with pytest.raises(BudgetError, match="already recorded"):
        _plan(
            accountant="rdp",
            stages=[Stage("loud", sample_rate=0.5, steps=50, training=False, noise_multiplier=0.5), Stage("dp-sgd")],
        )


def test_without_a_target_ratio_stages_scale_the_given_sigma():
    stages = [
        Stage("psel", sample_rate=0.02, steps=5, training=False, noise_ratio=0.5),
        Stage("fixed", steps=10, noise_multiplier=4.0),
        Stage("dp-sgd"),
    ]
    plan = _plan(target_epsilon=None, noise_multiplier=1.2, accountant="rdp", stages=stages)
    assert [p.noise_multiplier for p in plan.planned] == [0.6, 4.0, 1.2]
    assert plan.epsilon() == compute_epsilon(plan.planned_events(), plan.delta, "rdp")
    assert plan.max_training_steps(()) is None  # no target: no budget stop


# ---------------------------------------------------------------------- DP-FROST (methods_spec §2.7, §2.12)
def _frost_stages(sample_rate=None):
    return [
        Stage("psel", sample_rate=0.02, steps=5, training=False, sensitivity="Δ_t (Lemma 3)"),
        Stage("dp-frost", sample_rate=sample_rate, epsilon_share=0.9, sensitivity="flat L2 clip c"),
    ]


Q_FROST = 1024 / 67_349  # §2.12: q_SGD = 1024/67349 for every task, T_SGD = ⌊E/q_SGD⌋
FROST_REFERENCE = [  # (N, δ, T_SGD, ε, σ_SGD, σ_ps)
    *[(67_349, None, 197, eps, s, p) for eps, s, p in [(0.5, 2.109, 1.797), (2, 1.006, 0.908), (8, 0.602, 0.505)]],
    *[(104_743, None, 394, eps, s, p) for eps, s, p in [(0.5, 2.891, 1.836), (2, 1.118, 0.967), (8, 0.653, 0.522)]],
    *[(363_846, None, 1183, eps, s, p) for eps, s, p in [(0.5, 5.078, 1.953), (2, 1.582, 1.060), (8, 0.773, 0.569)]],
    *[(392_702, None, 1183, eps, s, p) for eps, s, p in [(0.5, 5.156, 1.953), (2, 1.587, 1.064), (8, 0.774, 0.570)]],
    *[(50_000, 1e-5, 150, eps, s, p) for eps, s, p in [(0.5, 2.344, 1.758), (2, 1.055, 0.908), (8, 0.621, 0.502)]],
]


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize(("size", "delta", "steps", "target", "sigma_sgd", "sigma_ps"), FROST_REFERENCE)
def test_frost_reference_noise_multipliers(size, delta, steps, target, sigma_sgd, sigma_ps, monkeypatch):
    """ComputeSigma (Algorithm 3) through the plan: σ_SGD for 0.9·ε alone, then σ_ps for ε on top of it.

    The table assumes exact Gaussian noise: the sampler's finite tail is left out of δ here (a δ a fraction of a
    percent smaller can move a bisection end point by a whole step).
    """
    monkeypatch.setattr(accountants, "sampler_tail_delta", lambda mechanisms, delta: 0.0)
    cifar = size == 50_000
    plan = PrivacyPlan(
        size,
        1000 if cifar else round(Q_FROST * size),
        steps=steps,
        delta=delta,
        accountant="rdp",
        target_epsilon=target,
        stages=_frost_stages(None if cifar else Q_FROST),
    )
    # The table's values are bisection end points rounded to 3 decimals: measured differences are at most 8e-4.
    assert plan["dp-frost"].noise_multiplier == pytest.approx(sigma_sgd, abs=1e-3)
    assert plan["psel"].noise_multiplier == pytest.approx(sigma_ps, abs=1e-3)
    assert plan.epsilon() <= target
    assert plan.start_steps == {"dp-frost": 0} and plan["psel"].start_step is None


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_frost_plan_is_algorithm_3(accountant):
    plan = _plan(accountant=accountant, target_epsilon=2.0, stages=_frost_stages())
    delta = plan.delta
    sigma_sgd = calibrate_noise_multiplier(0.9 * 2.0, delta, Q, 150, accountant=accountant)
    sigma_ps = calibrate_noise_multiplier(
        2.0, delta, 0.02, 5, accountant=accountant, prior=[MechanismGroup("dp-frost", sigma_sgd, Q, 150)]
    )
    assert plan["dp-frost"].noise_multiplier == sigma_sgd and plan["psel"].noise_multiplier == sigma_ps
    assert 2.0 - 0.01 <= plan.epsilon() <= 2.0


def test_epsilon_shares_are_calibrated_in_increasing_order():
    stages = [Stage("late", steps=50, epsilon_share=0.8), Stage("early", epsilon_share=0.5)]
    plan = _plan(accountant="rdp", stages=stages)
    early = calibrate_noise_multiplier(1.5, plan.delta, Q, 100, accountant="rdp", name="early")
    late = calibrate_noise_multiplier(
        2.4, plan.delta, Q, 50, accountant="rdp", prior=[MechanismGroup("early", early, Q, 100)]
    )
    assert (plan["early"].noise_multiplier, plan["late"].noise_multiplier) == (early, late)
    assert plan.epsilon() <= 0.8 * 3.0


# ---------------------------------------------------------------------- the budget stop
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_budget_stop_is_max_steps_within_for_one_mechanism(accountant):
    plan = _plan(accountant=accountant)
    sigma = plan["dp-sgd"].noise_multiplier
    ledger = PrivacyLedger(N, plan.delta, accountant)
    assert plan.max_training_steps(ledger.mechanisms) == max_steps_within(
        3.0, plan.delta, sigma, Q, accountant=accountant
    )
    assert plan.max_training_steps(ledger.mechanisms) >= 150  # the plan fits its budget
    ledger.record_event(plan.event("dp-sgd", steps=120, max_grad_norm=1.0))
    assert plan.max_training_steps(ledger.mechanisms) == max_steps_within(
        3.0, plan.delta, sigma, Q, accountant=accountant, prior=ledger.mechanisms
    )
    # Two stages with one (σ, q): the same limit as one mechanism, from any point of the schedule.
    two = _plan(accountant=accountant, stages=[Stage("dp-sgd", epochs=1.0), Stage("dp-bitfit")])
    assert two.max_training_steps(ledger.mechanisms) == plan.max_training_steps(ledger.mechanisms)
    early = [two.event("dp-sgd", steps=20)]
    assert two.max_training_steps(early) == max_steps_within(
        3.0, plan.delta, sigma, Q, accountant=accountant, prior=early
    )


def test_budget_stop_follows_the_schedule_and_reserves_unreleased_stages():
    stages = [
        Stage("psel", sample_rate=0.02, steps=5, training=False),
        Stage("loud", steps=30, noise_ratio=0.5),
        Stage("dp-sgd"),
    ]
    plan = _plan(accountant="rdp", stages=stages)
    loud, sgd, psel = plan["loud"], plan["dp-sgd"], plan["psel"]
    limit = plan.max_training_steps([])
    assert limit >= plan.planned_steps

    def eps(k):  # psel reserved, then k training steps along the schedule
        events = [psel.event(5), loud.event(min(k, 30))] + ([sgd.event(k - 30)] if k > 30 else [])
        return compute_epsilon(events, plan.delta, "rdp")

    assert eps(limit) <= 3.0 < eps(limit + 1)
    # The selection rounds count whether or not they are in the ledger yet; training steps exclude them.
    done = [psel.event(5), loud.event(10)]
    assert plan.training_steps(done) == 10
    assert plan.max_training_steps(done) == limit - 10 == plan.max_training_steps([loud.event(10)])


# ---------------------------------------------------------------------- no finite guarantee
def test_a_stage_without_guarantee_makes_the_plan_and_the_ledger_say_none():
    reason = "DP-FP paper mode trains the encoder below the noise on raw inputs (methods_spec §6.1)."
    plan = _plan(stages=[Stage("dp-fp-paper", noise_multiplier=0.35, no_guarantee=reason)])
    assert plan.guarantee == ("none", f"No finite (ε, δ) guarantee: dp-fp-paper: {reason}")
    assert plan.epsilon() == math.inf and plan.max_training_steps([]) is None
    event = plan.event("dp-fp-paper", steps=4)
    assert event.mechanism == NO_GUARANTEE and event.reason == reason
    ledger = PrivacyLedger(N, plan.delta)
    ledger.record_event(event)
    report = ledger.report()
    assert report["guarantee"] == "none" and reason in report["guarantee_note"] and report["epsilon"] == math.inf
    assert plan.to_dict()["guarantee"] == "none" and "guarantee: none" in plan.describe()
    # Other stages are still calibrated to the target (what they alone spend), and the plan still says none.
    mixed = _plan(accountant="rdp", stages=[Stage("forward", steps=10, no_guarantee=reason), Stage("dp-sgd")])
    assert mixed["dp-sgd"].noise_multiplier == calibrate_noise_multiplier(3.0, mixed.delta, Q, 140, accountant="rdp")
    assert mixed["forward"].noise_multiplier is None and mixed.guarantee[0] == "none"


def test_planned_stages_give_their_training_span_and_release_sigma():
    """[start, end) of a training stage's steps (none outside training); σ of a release, refused where undefined."""
    stages = [
        Stage("psel", sample_rate=0.02, steps=5, training=False, noise_multiplier=2.0),
        Stage("a", epochs=1.0),
        Stage("b"),
    ]
    plan = _plan(noise_multiplier=1.0, target_epsilon=None, stages=stages)
    assert plan["a"].training_span() == (0, 50) and plan["b"].training_span() == (50, 150)
    with pytest.raises(ValueError, match="outside the training steps"):
        plan["psel"].training_span()
    assert plan["psel"].release_noise_multiplier() == 2.0 and plan["b"].release_noise_multiplier() == 1.0
    mixed = _plan(accountant="rdp", stages=[Stage("forward", steps=10, no_guarantee="paper mode"), Stage("dp-sgd")])
    with pytest.raises(ValueError, match="has no σ"):
        mixed["forward"].release_noise_multiplier()


# ---------------------------------------------------------------------- inputs
def test_delta_is_resolved_like_dp_config():
    assert resolve_delta(N) == 1 / (2 * N) and _plan(noise_multiplier=1.0, target_epsilon=None).delta == 1 / (2 * N)
    assert _plan(noise_multiplier=1.0, target_epsilon=None, delta=1e-5).delta == 1e-5
    for delta in (1 / N, 0.01):
        with pytest.raises(ValueError, match="not below 1/N"):
            _plan(noise_multiplier=1.0, target_epsilon=None, delta=delta)


def test_steps_per_epoch_is_the_samplers():
    from hf_private.data.sampling import expected_steps_per_epoch

    for q in (1.0, 0.5, 0.3, 0.02, 1 / 3, 0.0152, 1e-4):
        assert steps_per_epoch(q) == expected_steps_per_epoch(q)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(steps=10), "exactly one of steps and epochs"),
        (dict(target_epsilon=None), "exactly one of target_epsilon"),
        (dict(expected_batch_size=N + 1), "exceeds the dataset size"),
        (dict(stages=[Stage("a"), Stage("a", steps=3)]), "unique"),
        (dict(stages=[Stage("a"), Stage("b")]), "Only the last training stage"),
        (dict(stages=[Stage("a", steps=10)]), "cover 10 of the 150"),
        (dict(stages=[Stage("p", steps=3, training=False)]), "at least one training stage"),
        (dict(stages=[Stage("b", steps=1, epsilon_share=0.5), Stage("a", epsilon_share=0.5)]), "must differ"),
        (dict(stages=[Stage("a", steps=10, epsilon_share=1.0), Stage("b")]), "whole target"),
        (dict(target_epsilon=None, noise_multiplier=1.0, stages=[Stage("a", epsilon_share=0.5)]), "needs target"),
    ],
)
def test_plan_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _plan(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(steps=1, epochs=1.0), "steps or epochs"),
        (dict(training=False), "give its steps"),
        (dict(noise_multiplier=1.0, noise_ratio=2.0), "at most one of"),
        (dict(epsilon_share=1.5), "epsilon_share"),
        (dict(noise_ratio=0.0), "noise_ratio"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(no_guarantee=" "), "reason"),
    ],
)
def test_stage_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Stage("s", **kwargs)


def test_description_and_dict_name_every_stage():
    plan = _plan(accountant="rdp", stages=_frost_stages())
    text = plan.describe()
    for planned in plan.planned:
        assert planned.name in text and f"σ={planned.noise_multiplier:.4g}" in text
    assert "outside training steps" in text and "sensitivity: flat L2 clip c" in text
    d = json.loads(json.dumps(plan.to_dict()))
    assert [s["name"] for s in d["stages"]] == ["psel", "dp-frost"]
    assert d["stages"][0]["start_step"] is None and d["stages"][1]["calibration"] == "share"


def test_plan_calibrates_at_delta_minus_the_sampler_tail():
    """q = 0.002, ε = 20: σ ≈ 0.32, where the sampler's finite tail takes about 1% of δ; σ is calibrated for ε at
    δ − δ_tail, so it is at least the σ calibrated as if the noise were exactly Gaussian."""
    plan = PrivacyPlan(50_000, 100, epochs=1, target_epsilon=20.0, accountant="rdp")
    (event,) = plan.planned_events()
    tail = accountants.sampler_tail_delta([event], plan.delta)
    assert 1e-3 * plan.delta < tail < 0.1 * plan.delta
    history = [(event.noise_multiplier, event.sample_rate, event.steps)]
    assert plan.epsilon() == rdp_epsilon(history, plan.delta - tail)
    assert rdp_epsilon(history, plan.delta) < 20.0 - 0.01 <= plan.epsilon() <= 20.0  # δ alone: too low
    exact_gaussian = calibrate_noise_multiplier(
        20.0, plan.delta - tail, event.sample_rate, event.steps, accountant="rdp"
    )
    assert event.noise_multiplier >= exact_gaussian - 0.01


def test_plan_refuses_a_sigma_below_the_sampler_tail_floor():
    with pytest.raises(BudgetError, match=r"finite tail.*smaller target ε") as refused:
        PrivacyPlan(50_000, 100, epochs=1, target_epsilon=30.0, accountant="rdp")  # σ ≈ 0.28
    floor = float(re.search(r"every σ ≥ ([0-9.]+)", str(refused.value), re.IGNORECASE).group(1))
    PrivacyPlan(50_000, 100, epochs=1, noise_multiplier=floor * 1.001, accountant="rdp")  # the floor suffices
    with pytest.raises(BudgetError, match="raise noise_multiplier"):
        PrivacyPlan(50_000, 100, epochs=1, noise_multiplier=floor * 0.99, accountant="rdp")
    with pytest.raises(BudgetError, match="No σ would do"):  # the restriction to the discs, over 1e9 releases
        PrivacyPlan(10**6, 1, steps=10**9, noise_multiplier=100.0, accountant="rdp")
