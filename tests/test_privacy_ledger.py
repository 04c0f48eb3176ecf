"""The privacy ledger (recording, caching, persistence) and the secret generator."""

import json
import math

import pytest

import hf_private.privacy.ledger as ledger_module
from hf_private.privacy import MechanismGroup, PrivacyLedger
from hf_private.privacy.accountants import epsilon_bound

N = 10_000
DELTA = 1 / (2 * N)


def test_record_merges_consecutive_identical_mechanisms():
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    for _ in range(3):
        ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0)
    ledger.record("psel", 2.0, 0.02, steps=5)
    ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0, steps=2)
    ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=0.5)  # another C: another release
    assert [(g.name, g.steps, g.max_grad_norm) for g in ledger.mechanisms] == [
        ("dp-sgd", 3, 1.0), ("psel", 5, None), ("dp-sgd", 2, 1.0), ("dp-sgd", 1, 0.5),
    ]
    assert ledger.total_steps == 11


def test_epsilon_is_cached_until_the_history_changes(monkeypatch):
    calls = []

    def counting(mechanisms, delta, accountant):
        calls.append(len(mechanisms))
        return epsilon_bound(mechanisms, delta, accountant)

    monkeypatch.setattr(ledger_module, "epsilon_bound", counting)
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    assert ledger.epsilon() == 0.0
    ledger.record("dp-sgd", 1.0, 0.01, steps=100)
    first = ledger.epsilon()
    assert ledger.epsilon() == first and len(calls) == 2
    ledger.record("dp-sgd", 1.0, 0.01)
    assert ledger.epsilon() > first and len(calls) == 3
    ledger.load_state_dict(ledger.state_dict())
    ledger.epsilon()
    assert len(calls) == 4


def test_epsilon_if_does_not_mutate():
    ledger = PrivacyLedger(N, DELTA)
    ledger.record("dp-sgd", 1.0, 0.01, steps=200)
    before, state = ledger.epsilon(), ledger.state_dict()
    hypothetical = ledger.epsilon_if("dp-sgd", 1.0, 0.01, steps=50)
    assert ledger.state_dict() == state and ledger.epsilon() == before
    assert hypothetical > before
    ledger.record("dp-sgd", 1.0, 0.01, steps=50)
    assert ledger.epsilon() == hypothetical


def test_state_dict_save_load_round_trip(tmp_path):
    ledger = PrivacyLedger(N, DELTA, accountant="prv")
    ledger.record("dp-sgd", 0.9, 0.01, max_grad_norm=1.0, steps=300)
    ledger.record("psel", 3.0, 0.02, steps=5)
    state = ledger.state_dict()
    assert state["format_version"] == 1
    assert json.loads(json.dumps(state)) == state
    path = tmp_path / "privacy_ledger.json"
    ledger.save(path)
    loaded = PrivacyLedger.load(path)
    assert loaded.state_dict() == state
    assert loaded.epsilon() == ledger.epsilon()
    assert loaded.mechanisms == ledger.mechanisms

    fresh = PrivacyLedger(N, DELTA, accountant="prv")
    fresh.load_state_dict(state)
    assert fresh.epsilon() == ledger.epsilon()
    with pytest.raises(ValueError, match="format_version"):
        fresh.load_state_dict(state | {"format_version": 2})


def test_report():
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0, steps=10)
    report = ledger.report()
    assert set(report) == {"epsilon", "delta", "accountant", "dataset_size", "steps", "mechanisms"}
    assert report["steps"] == 10 and report["accountant"] == "rdp" and report["epsilon"] == ledger.epsilon()
    assert report["mechanisms"] == [
        {"name": "dp-sgd", "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 10, "max_grad_norm": 1.0}
    ]


def test_mechanism_group_round_trip_and_identity():
    group = MechanismGroup("dp-sgd", 1.0, 0.01, 3, 1.0)
    assert set(group.to_dict()) == {"name", "noise_multiplier", "sample_rate", "steps", "max_grad_norm"}
    assert MechanismGroup.from_dict(group.to_dict()) == group
    assert group.same_mechanism(MechanismGroup("dp-sgd", 1.0, 0.01, 99, 1.0))
    assert not group.same_mechanism(MechanismGroup("dp-sgd", 1.0, 0.01, 3, 2.0))
    assert not group.same_mechanism(MechanismGroup("psel", 1.0, 0.01, 3, 1.0))


def test_validation():
    with pytest.raises(ValueError, match="prv, rdp"):
        PrivacyLedger(N, DELTA, accountant="gdp")
    for delta in (1.0, 0.0, 2.0):
        with pytest.raises(ValueError, match="delta"):
            PrivacyLedger(N, delta)
    with pytest.raises(ValueError, match="dataset_size"):
        PrivacyLedger(0, DELTA)
    ledger = PrivacyLedger(N, DELTA)
    with pytest.raises(ValueError, match="sample_rate"):
        ledger.record("dp-sgd", 1.0, 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        ledger.record("dp-sgd", -1.0, 0.01)
    with pytest.raises(ValueError, match="steps"):
        ledger.record("dp-sgd", 1.0, 0.01, steps=0)
    assert ledger.mechanisms == []


def _simulate(monkeypatch, accountant, phases, max_steps=None):
    """Record one step at a time as training does; (bounds logged, exact ε, accountant evaluations for the logs)."""
    calls = []

    def counting(mechanisms, delta, accountant):
        calls.append(sum(group.steps for group in mechanisms))
        return epsilon_bound(mechanisms, delta, accountant)

    monkeypatch.setattr(ledger_module, "epsilon_bound", counting)
    ledger = PrivacyLedger(N, DELTA, accountant=accountant)
    bounds, exact, evaluations = [], [], 0
    for name, sigma, q, steps in phases:
        for _ in range(steps):
            ledger.record(name, sigma, q, max_grad_norm=1.0)
            before = len(calls)
            bounds.append(ledger.epsilon_upper_bound(max_steps=max_steps))
            evaluations += len(calls) - before
            exact.append(ledger.epsilon())
    return bounds, exact, evaluations


SINGLE = [("dp-sgd", 1.0, 0.01, 300)]
# Then a costlier mechanism (twice the rate): a look-ahead that still assumed the first would fall below ε.
SWITCH = [("dp-sgd", 1.0, 0.01, 200), ("bitfit", 1.0, 0.02, 100)]


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("phases", [SINGLE, SWITCH], ids=["single", "phase-switch"])
def test_epsilon_upper_bound_is_an_upper_bound_that_tracks_progress(monkeypatch, accountant, phases):
    bounds, exact, evaluations = _simulate(monkeypatch, accountant, phases)
    assert all(bound >= eps for bound, eps in zip(bounds, exact))  # at every step
    assert evaluations <= 20  # not one accountant call per logged step
    # It follows the steps taken (never above the exact ε of 1.5x as many steps), not the planned total.
    for t in range(1, len(exact) * 2 // 3 + 1):
        assert bounds[t - 1] <= exact[math.ceil(1.5 * t) - 1]
    assert bounds[0] < bounds[-1]


def test_epsilon_upper_bound_stays_within_max_steps_and_keeps_the_exact_epsilon_exact(monkeypatch):
    bounds, exact, _ = _simulate(monkeypatch, "rdp", [("dp-sgd", 1.0, 0.01, 100)], max_steps=100)
    assert all(eps <= bound <= exact[-1] for bound, eps in zip(bounds, exact))
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 1.0, 0.01, steps=100)
    assert exact[-1] == ledger.epsilon() == ledger.report()["epsilon"]
