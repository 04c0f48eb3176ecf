"""The accountant registry: one file per accountant, and every choice of accountant read from the table.

A toy accountant registered here must be offered and used everywhere an accountant is chosen (ε, the ledger, the
plan's calibration, `DPConfig`, `hf-private-audit`), an unknown name refused with the registered ones listed, and
the shipped ones found each in its own file.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import pkgutil
from collections.abc import Sequence

import pytest

import hf_private.privacy.accountants as accountants
from hf_private import DPConfig
from hf_private.cli.audit import _parser
from hf_private.privacy import (
    SUPPORTED_ACCOUNTANTS,
    BudgetError,
    MechanismGroup,
    PrivacyLedger,
    PrivacyPlan,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from hf_private.privacy.accountants import (
    Accountant,
    accountant_named,
    epsilon_bound,
    register_accountant,
    registered_accountants,
    sampler_tail_delta,
)
from hf_private.privacy.accountants import registry as registry_module
from hf_private.privacy.events import Releases

DELTA = 1e-5


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are gone after it (the shipped ones stay)."""
    monkeypatch.setattr(registry_module, "_ACCOUNTANTS", dict(registry_module._ACCOUNTANTS))


def _toy_epsilon(releases: Sequence[Releases]) -> float:
    """A made-up bound, decreasing in σ: Σ steps·q·k/σ."""
    return math.fsum(steps * q * k / sigma for sigma, q, k, steps in releases)


def _register_toy(name: str = "toy", seed: str | None = None, calls: list | None = None) -> type[Accountant]:
    @register_accountant(name)
    class Toy(Accountant):
        search_seed = seed
        budget_hint = "The toy accountant is very pessimistic."

        def epsilon(self, releases: Sequence[Releases], delta: float) -> tuple[float, str]:
            if calls is not None:
                calls.append((list(releases), delta))
            return _toy_epsilon(releases), name

    return Toy


def test_the_shipped_accountants_are_registered_and_exported():
    assert registered_accountants() == ("prv", "rdp")
    assert SUPPORTED_ACCOUNTANTS == registered_accountants()
    assert accountants.SUPPORTED_ACCOUNTANTS is SUPPORTED_ACCOUNTANTS


def test_every_registered_accountant_has_its_own_file():
    """`<name>.py` in the package defines the class registered as `name`, and every Accountant defined in the
    package's files is registered."""
    package = pathlib.Path(accountants.__file__).parent
    for name in registered_accountants():
        cls = type(accountant_named(name))
        assert cls.__module__ == f"{accountants.__name__}.{name}", (name, cls.__module__)
        assert (package / f"{name}.py").is_file()
    registered = {type(accountant_named(name)) for name in registered_accountants()}
    for info in pkgutil.iter_modules([str(package)]):
        module = importlib.import_module(f"{accountants.__name__}.{info.name}")
        defined = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, Accountant)
            and value is not Accountant
            and value.__module__ == module.__name__
        ]
        assert all(cls in registered for cls in defined), (info.name, defined)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_the_registry_answers_what_the_accountant_file_computes(accountant):
    """`epsilon_bound` merges the events, takes the sampler tail out of δ and asks the registered accountant."""
    groups = [MechanismGroup("a", 1.0, 0.01, 50), MechanismGroup("b", 2.0, 0.1, 3), MechanismGroup("a", 1.0, 0.01, 50)]
    at = DELTA - sampler_tail_delta(groups, DELTA)
    expected = accountant_named(accountant).epsilon([Releases(1.0, 0.01, 1, 100), Releases(2.0, 0.1, 1, 3)], at)
    assert epsilon_bound(groups, DELTA, accountant) == expected


def test_an_unknown_accountant_is_refused_naming_the_registered_ones():
    said = r"Unknown accountant 'gdp': choose one of prv, rdp\."
    history = [MechanismGroup("dp-sgd", 1.0, 0.01, 10)]
    for refuse in (
        lambda: compute_epsilon(history, DELTA, "gdp"),
        lambda: PrivacyLedger(1000, DELTA, accountant="gdp"),
        lambda: PrivacyPlan(1000, 10, steps=10, delta=DELTA, accountant="gdp", noise_multiplier=1.0),
        lambda: calibrate_noise_multiplier(1.0, DELTA, 0.01, 10, accountant="gdp"),
        lambda: DPConfig(noise_multiplier=1.0, accountant="gdp"),
    ):
        with pytest.raises(ValueError, match=said):
            refuse()
    with pytest.raises(SystemExit):
        _parser().parse_args(["--accountant", "gdp"])


@pytest.mark.usefixtures("isolated_registry")
def test_a_registered_accountant_is_offered_and_used(capsys):
    calls: list = []
    _register_toy(calls=calls)
    assert registered_accountants() == ("prv", "rdp", "toy")
    history = [
        MechanismGroup("dp-sgd", 2.0, 0.01, 30),
        MechanismGroup.els("dp-sgd", 2.0, 0.01, 4, 10),
        MechanismGroup("dp-sgd", 2.0, 0.01, 20),
    ]
    assert epsilon_bound(history, DELTA, "toy") == (_toy_epsilon([(2.0, 0.01, 1, 50), (2.0, 0.01, 4, 10)]), "toy")
    # What the accountant is given: the merged releases, at δ minus the sampler's tail.
    assert calls[-1] == ([(2.0, 0.01, 1, 50), (2.0, 0.01, 4, 10)], DELTA - sampler_tail_delta(history, DELTA))
    # What it is spared: an empty history, an un-noised release.
    calls.clear()
    assert epsilon_bound([], DELTA, "toy") == (0.0, "toy")
    assert compute_epsilon([MechanismGroup.no_guarantee("dp-fp", "raw inputs")], DELTA, "toy") == math.inf
    assert calls == []

    ledger = PrivacyLedger(1000, DELTA, accountant="toy")
    ledger.record("dp-sgd", 2.0, 0.01, steps=50)
    assert ledger.report()["accountant"] == "toy" and ledger.epsilon() == _toy_epsilon([(2.0, 0.01, 1, 50)])

    # Searched by itself (no seed): the calibrated σ meets the target under the toy bound.
    sigma = calibrate_noise_multiplier(0.5, DELTA, 0.01, 100, accountant="toy")
    assert 0.49 <= compute_epsilon([MechanismGroup("dp-sgd", sigma, 0.01, 100)], DELTA, "toy") <= 0.5
    with pytest.raises(BudgetError, match="The toy accountant is very pessimistic."):
        calibrate_noise_multiplier(0.5, DELTA, 0.01, 100, accountant="toy", max_noise_multiplier=1.0)

    assert DPConfig(noise_multiplier=1.0, accountant="toy").accountant == "toy"
    assert _parser().parse_args(["--accountant", "toy"]).accountant == "toy"
    _parser().print_help()
    assert "{prv,rdp,toy}" in capsys.readouterr().out


@pytest.mark.usefixtures("isolated_registry")
def test_a_search_seed_starts_the_search_and_the_accountant_finishes_it(monkeypatch):
    """PRV's searches start from RDP's answer; a toy seeded by "rdp" is asked only after RDP's bisection."""
    asked: list[str] = []
    rdp = accountant_named("rdp")
    monkeypatch.setattr(
        type(rdp), "epsilon", lambda self, releases, delta: asked.append("rdp") or (_toy_epsilon(releases) * 2, "rdp")
    )
    _register_toy("seeded", seed="rdp")
    original = accountant_named("seeded").epsilon
    monkeypatch.setattr(
        type(accountant_named("seeded")),
        "epsilon",
        lambda self, releases, delta: asked.append("seeded") or original(releases, delta),
    )
    sigma = calibrate_noise_multiplier(0.5, DELTA, 0.01, 100, accountant="seeded")
    assert 0.49 <= compute_epsilon([MechanismGroup("dp-sgd", sigma, 0.01, 100)], DELTA, "seeded") <= 0.5
    first_seeded = asked.index("seeded")
    assert first_seeded > 0 and set(asked[:first_seeded]) == {"rdp"} and "rdp" not in asked[first_seeded:]
    assert accountant_named("prv").search_seed == "rdp" and accountant_named("rdp").search_seed is None


@pytest.mark.usefixtures("isolated_registry")
def test_a_broken_registration_is_refused():
    _register_toy()
    with pytest.raises(ValueError, match="'toy' is already registered"):
        _register_toy()
    with pytest.raises(ValueError, match="seeded by 'nothing', which is not registered"):
        _register_toy("orphan", seed="nothing")
    with pytest.raises(TypeError, match="decorates an Accountant subclass"):
        register_accountant("plain")(object)
    assert registered_accountants() == ("prv", "rdp", "toy")
