"""`hf_private.run.report` on its own: the plan's lines and the report are functions of the plan, config, ledger and
method, with no run or trainer behind them."""

from __future__ import annotations

import math

from hf_private import DPConfig
from hf_private.privacy import PrivacyLedger, PrivacyPlan
from hf_private.run.report import NOISY_UPDATE, plan_lines, privacy_report, without_guarantee

SUBJECT = {"unit": "example", "trainer": "Trainer", "base_model": None}


def _plan(sigma: float, batch: int = 50) -> PrivacyPlan:
    return PrivacyPlan(1000, batch, steps=20, noise_multiplier=sigma)


def test_the_plan_is_one_line_and_names_what_it_rests_on():
    plan = _plan(1.0)
    (line,) = plan_lines(
        plan, DPConfig(noise_multiplier=1.0), "example", None, mechanism="dp-sgd", noise_multiplier=1.0
    )
    assert line.startswith(
        "Private training plan (dp-sgd): N=1000 examples, sampling rate q=0.05 (expected logical "
        "batch 50 examples), 20 steps, noise multiplier σ=1, clip norm C=1, δ=0.0005, prv "
        "accountant"
    )


def test_a_noisy_update_and_a_test_seed_are_said():
    sigma = 2 * NOISY_UPDATE * 10
    lines = plan_lines(
        _plan(sigma, batch=10),
        DPConfig(noise_multiplier=sigma, noise_seed=3),
        "example",
        None,
        mechanism="dp-sgd",
        noise_multiplier=sigma,
    )
    assert len(lines) == 2
    assert lines[0].startswith("Training plan in insecure test mode, WITHOUT a privacy guarantee (dp-sgd)")
    assert lines[1].startswith("The model will be mostly noise: σ=1 over an expected batch of 10 examples")


def test_the_report_is_the_ledgers_with_the_runs_settings():
    plan, config = _plan(1.0), DPConfig(noise_multiplier=1.0)
    ledger = PrivacyLedger(1000, plan.delta, "prv")
    ledger.record_event(plan.event("dp-sgd", 4, 1.0))
    method = config.build_method()
    report = privacy_report(ledger, plan, config, SUBJECT, method, [], noise_multiplier=1.0, trainable_fraction=0.25)
    assert report["guarantee"] == "formal" and report["steps"] == 4 and report["planned_steps"] == 20
    assert report["epsilon"] == ledger.epsilon() and report["trainable_fraction"] == 0.25
    assert report["phases"] == [{"mechanism": "dp-sgd", "from_step": 0}] and report["method"] == "dp-sgd"

    seeded = DPConfig(noise_multiplier=1.0, noise_seed=7)
    report = privacy_report(ledger, plan, seeded, SUBJECT, method, [], noise_multiplier=1.0, trainable_fraction=0.25)
    assert report["guarantee"] == "none" and "epsilon" not in report
    assert "insecure test mode" in report["guarantee_note"]
    assert math.isclose(report["not_a_guarantee"]["accounting_with_a_secret_seed"]["value"], ledger.epsilon())


def test_without_a_guarantee_no_number_is_called_epsilon():
    report = without_guarantee(
        {"epsilon": math.inf, "training_epsilon": 1.0, "accountant": "prv"},
        {"paper": {"value": 2.0, "what": "the paper's figure"}},
    )
    assert report == {"accountant": "prv", "not_a_guarantee": {"paper": {"value": 2.0, "what": "the paper's figure"}}}
