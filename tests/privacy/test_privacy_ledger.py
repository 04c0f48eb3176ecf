"""The privacy ledger (recording, caching, persistence) and the secret generator."""

import json
import math

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

import hf_private.privacy.ledger as ledger_module
from hf_private.privacy import NO_GUARANTEE, POISSON_GAUSSIAN, MechanismGroup, PrivacyLedger, compute_epsilon
from hf_private.privacy.accountants import epsilon_bound
from hf_private.privacy.rng import tail_mass

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
        ("dp-sgd", 3, 1.0),
        ("psel", 5, None),
        ("dp-sgd", 2, 1.0),
        ("dp-sgd", 1, 0.5),
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
    assert state["format_version"] == 2
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
        fresh.load_state_dict(state | {"format_version": 3})


# A ledger as version 1 wrote it (before typed events): every group a Poisson-subsampled Gaussian.
VERSION_1 = {
    "format_version": 1,
    "dataset_size": N,
    "delta": DELTA,
    "accountant": "prv",
    "mechanisms": [
        {"name": "dp-sgd", "noise_multiplier": 0.9, "sample_rate": 0.01, "steps": 300, "max_grad_norm": 1.0},
        {"name": "psel", "noise_multiplier": 3.0, "sample_rate": 0.02, "steps": 5, "max_grad_norm": None},
    ],
}


def test_format_version_1_still_loads(tmp_path):
    path = tmp_path / "privacy_ledger.json"
    path.write_text(json.dumps(VERSION_1))
    loaded = PrivacyLedger.load(path)
    recorded = PrivacyLedger(N, DELTA, accountant="prv")
    recorded.record("dp-sgd", 0.9, 0.01, max_grad_norm=1.0, steps=300)
    recorded.record("psel", 3.0, 0.02, steps=5)
    assert loaded.mechanisms == recorded.mechanisms
    assert all(group.mechanism == POISSON_GAUSSIAN for group in loaded.mechanisms)
    assert loaded.epsilon() == recorded.epsilon() and loaded.guarantee() == ("formal", None)
    loaded.record("dp-sgd", 0.9, 0.01, max_grad_norm=1.0)  # resuming continues it, and saves version 2
    loaded.save(path)
    state = json.loads(path.read_text())
    assert state["format_version"] == 2 and [m["mechanism"] for m in state["mechanisms"]] == [POISSON_GAUSSIAN] * 3
    typed_v1 = json.loads(json.dumps(VERSION_1))
    typed_v1["mechanisms"][0]["mechanism"] = NO_GUARANTEE
    with pytest.raises(ValueError, match="no typed events"):
        PrivacyLedger(N, DELTA).load_state_dict(typed_v1)


def test_report():
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0, steps=10)
    report = ledger.report()
    assert set(report) == {
        "epsilon",
        "delta",
        "sampler_tail_delta",
        "accountant",
        "dataset_size",
        "steps",
        "mechanisms",
        "guarantee",
    }
    assert report["steps"] == 10 and report["accountant"] == "rdp" and report["epsilon"] == ledger.epsilon()
    assert 0 < report["sampler_tail_delta"] < 1e-4 * DELTA
    assert report["guarantee"] == "formal"
    assert report["mechanisms"] == [
        {
            "name": "dp-sgd",
            "noise_multiplier": 1.0,
            "sample_rate": 0.01,
            "steps": 10,
            "max_grad_norm": 1.0,
            "mechanism": POISSON_GAUSSIAN,
        }
    ]


def test_mechanism_group_round_trip_and_identity():
    group = MechanismGroup("dp-sgd", 1.0, 0.01, 3, 1.0)
    assert group.mechanism == POISSON_GAUSSIAN
    assert set(group.to_dict()) == {"name", "noise_multiplier", "sample_rate", "steps", "max_grad_norm", "mechanism"}
    assert MechanismGroup.from_dict(group.to_dict()) == group
    assert group.same_mechanism(MechanismGroup("dp-sgd", 1.0, 0.01, 99, 1.0))
    assert not group.same_mechanism(MechanismGroup("dp-sgd", 1.0, 0.01, 3, 2.0))
    assert not group.same_mechanism(MechanismGroup("psel", 1.0, 0.01, 3, 1.0))
    none = MechanismGroup.no_guarantee("dp-fp-paper", "encoder trained on raw inputs", steps=2)
    assert not none.same_mechanism(MechanismGroup.no_guarantee("dp-fp-paper", "another reason", steps=2))
    for event in (group, none):
        assert MechanismGroup.from_dict(json.loads(json.dumps(event.to_dict()))) == event
        # Cached composition (hf_private.audit.result) rebuilds groups positionally from the serialised values.
        assert MechanismGroup(*event.to_dict().values()) == event


def test_typed_event_validation():
    with pytest.raises(ValueError, match="say why"):
        MechanismGroup.no_guarantee("dp-fp-paper", "", steps=1)
    with pytest.raises(ValueError, match="Only a no-guarantee event"):
        MechanismGroup("dp-sgd", 1.0, 0.01, 1, reason="because")
    with pytest.raises(ValueError, match="Unknown mechanism type"):
        MechanismGroup("dp-sgd", 1.0, 0.01, 1, mechanism="laplace")
    with pytest.raises(ValueError, match="un-noised"):  # a real σ would let a careless accountant report it
        MechanismGroup("dp-fp-paper", 0.35, 0.001, 1, mechanism=NO_GUARANTEE, reason="encoder trained on raw inputs")
    with pytest.raises(ValueError, match="steps"):
        PrivacyLedger(N, DELTA).record_no_guarantee("dp-fp-paper", "reason", steps=0)


REASON = "DP-FP paper mode: the encoder below the noise is trained on raw inputs (methods_spec §6.1)."


@pytest.mark.filterwarnings("ignore:Optimal order")
def test_a_release_without_guarantee_makes_epsilon_infinite_and_the_report_say_none(tmp_path, caplog):
    ledger = PrivacyLedger(N, DELTA, accountant="prv")
    ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0, steps=10)
    assert ledger.guarantee() == ("formal", None)
    ledger.record_no_guarantee("dp-fp-paper", REASON, steps=3)
    ledger.record_no_guarantee("dp-fp-paper", REASON)  # merged with the previous
    assert [(g.mechanism, g.steps) for g in ledger.mechanisms] == [(POISSON_GAUSSIAN, 10), (NO_GUARANTEE, 4)]
    assert "no finite privacy guarantee" in caplog.text
    kind, reason = ledger.guarantee()
    assert kind == "none" and REASON in reason
    assert ledger.epsilon() == math.inf
    report = ledger.report()
    assert report["guarantee"] == "none" and REASON in report["guarantee_note"] and report["epsilon"] == math.inf
    assert report["mechanisms"][1] == {
        "name": "dp-fp-paper",
        "noise_multiplier": 0.0,
        "sample_rate": 1.0,
        "steps": 4,
        "max_grad_norm": None,
        "mechanism": NO_GUARANTEE,
        "reason": REASON,
    }
    # From the card alone, any accountant gives ∞, even one that ignores the event type.
    groups = [MechanismGroup.from_dict(m) for m in report["mechanisms"]]
    assert compute_epsilon(groups, DELTA, "prv") == math.inf == compute_epsilon(groups, DELTA, "rdp")
    opacus_rdp = RDPAccountant()
    opacus_rdp.history = [(m["noise_multiplier"], m["sample_rate"], m["steps"]) for m in report["mechanisms"]]
    assert opacus_rdp.get_epsilon(DELTA) == math.inf
    path = tmp_path / "privacy_ledger.json"
    ledger.save(path)
    assert PrivacyLedger.load(path).guarantee() == (kind, reason)  # a resumed run still has none


def test_an_unnoised_gaussian_release_has_no_guarantee_either():
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 0.0, 0.01, steps=2)
    kind, reason = ledger.guarantee()
    assert kind == "none" and "without noise" in reason and ledger.epsilon() == math.inf


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_reported_epsilon_is_recomputable_with_opacus_from_the_serialised_events(accountant):
    """The card's `mechanisms`, as JSON, give opacus' own ε: (σ, q, steps) per event, composed at the card's δ
    minus its `sampler_tail_delta`."""
    ledger = PrivacyLedger(N, DELTA, accountant=accountant)
    released = [
        ("psel", 2.5, 0.02, 5),
        *[("dp-sgd", 1.1, 0.01, 40)] * 3,
        ("dp-sgd", 1.3, 0.01, 10),
        ("dp-bitfit", 1.1, 0.01, 30),
    ]
    for name, sigma, q, steps in released:
        ledger.record(name, sigma, q, max_grad_norm=1.0, steps=steps)
    card = json.loads(json.dumps(ledger.report()))
    assert card["accountant"] == accountant and card["guarantee"] == "formal"
    at = card["delta"] - card["sampler_tail_delta"]
    kwargs = {"eps_error": 0.01, "delta_error": at / 1000} if accountant == "prv" else {}
    from_card, as_released = ({"prv": PRVAccountant, "rdp": RDPAccountant}[card["accountant"]]() for _ in range(2))
    for event in card["mechanisms"]:
        assert event["mechanism"] == POISSON_GAUSSIAN
        for _ in range(event["steps"]):
            from_card.step(noise_multiplier=event["noise_multiplier"], sample_rate=event["sample_rate"])
    for _, sigma, q, steps in released:
        for _ in range(steps):
            as_released.step(noise_multiplier=sigma, sample_rate=q)
    assert card["epsilon"] == pytest.approx(from_card.get_epsilon(at, **kwargs), rel=1e-9)
    assert card["epsilon"] == pytest.approx(as_released.get_epsilon(at, **kwargs), rel=1e-9)


def test_epsilon_is_the_accountants_at_delta_minus_the_sampler_tail():
    """At σ = 0.25 the sampler's finite tail takes half of δ over 500 steps: ε is RDP's at what is left."""
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 0.25, 0.01, steps=500)
    report = ledger.report()
    tail = report["sampler_tail_delta"]
    assert tail == pytest.approx(500 * tail_mass(0.25), rel=1e-3) and 0.4 * DELTA < tail < 0.6 * DELTA
    opacus = RDPAccountant()
    opacus.history = [(0.25, 0.01, 500)]
    assert report["epsilon"] == pytest.approx(opacus.get_epsilon(DELTA - tail), rel=1e-12)
    assert report["epsilon"] > opacus.get_epsilon(DELTA) + 0.1


def test_a_release_whose_sampler_tail_reaches_delta_is_kept_and_refused():
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    ledger.record("dp-sgd", 0.2, 0.01, steps=4)  # 6.9e-6 per release at σ = 0.2, δ = 5e-5
    with pytest.raises(ValueError, match="finite tail alone spends"):
        ledger.record("dp-sgd", 0.2, 0.01, steps=4)
    assert ledger.total_steps == 8 and ledger.epsilon() == math.inf  # the release happened: it stays recorded
    kind, reason = ledger.guarantee()
    assert kind == "none" and "finite tail" in reason and ledger.report()["guarantee"] == "none"


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


SINGLE = [("dp-sgd", 1.0, 0.01, 300)]
# Then a costlier mechanism (twice the rate): a new group of the history, composed with the first.
SWITCH = [("dp-sgd", 1.0, 0.01, 200), ("bitfit", 1.0, 0.02, 100)]


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("phases", [SINGLE, SWITCH], ids=["single", "phase-switch"])
def test_epsilon_never_decreases_with_releases_and_is_evaluated_once_per_history(monkeypatch, accountant, phases):
    """The training logs carry `epsilon()` at each logging step (ε spent so far): the accountants' numbers must not
    decrease as releases are added (whoever sees more outputs can ignore the extra ones), and a history is evaluated
    once however often it is asked for."""
    calls = []

    def counting(mechanisms, delta, accountant):
        calls.append(sum(group.steps for group in mechanisms))
        return epsilon_bound(mechanisms, delta, accountant)

    monkeypatch.setattr(ledger_module, "epsilon_bound", counting)
    ledger = PrivacyLedger(N, DELTA, accountant=accountant)
    epsilons = []
    for name, sigma, q, steps in phases:
        for _ in range(steps):
            ledger.record(name, sigma, q, max_grad_norm=1.0)
            epsilons.append(ledger.epsilon())
            assert ledger.epsilon() == epsilons[-1]
    assert epsilons == sorted(epsilons) and calls == list(range(1, len(epsilons) + 1))
    assert epsilons[-1] == compute_epsilon(ledger.mechanisms, DELTA, accountant)
