"""`MethodRun` (hf_private/methods/base.py) is the whole contract between a method and its run: the run's view
(`run/method_view.py`) implements exactly it, every method's hook calls only what it declares, and a release's noise
is the plan's, never the method's."""

from __future__ import annotations

import ast
import inspect
import pathlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_private.methods.base import MethodRun
from hf_private.privacy import MechanismGroup, PlannedStage, Stage
from hf_private.run.method_view import MethodView

METHODS = pathlib.Path(__file__).resolve().parents[2] / "hf_private" / "methods"
CONTRACT = {name for name in vars(MethodRun) if not name.startswith("_")}


def _view(sigma: float = 2.0, ledger_groups: list | None = None) -> tuple[MethodView, dict]:
    """A view on stand-ins for the run's parts, and what it did with them."""
    seen: dict = {"noise_std": [], "recorded": [], "suspended": 0}

    class Noise:
        def add_(self, tensors, std):
            seen["noise_std"].append(std)
            for tensor in tensors:
                tensor.add_(1.0)  # a visible draw

    def suspend() -> None:
        seen["suspended"] += 1

    selection = Stage("selection", steps=3, training=False)
    plan = {"selection": PlannedStage(selection, sample_rate=0.5, steps=3, start_step=None, noise_multiplier=sigma)}
    ledger = SimpleNamespace(mechanisms=ledger_groups or [])
    view = MethodView(
        nn.Linear(2, 1),
        plan,
        SimpleNamespace(),
        max_grad_norm=1.0,
        noise=Noise(),
        random=None,
        ledger=lambda: ledger,
        record_release=seen["recorded"].append,
        suspend_training_engine=suspend,
    )
    return view, seen


def test_the_contract_is_what_a_method_needs():
    assert CONTRACT == {"model", "plan", "poisson_sample", "new_engine", "accumulate", "releases", "release"}


def test_the_run_view_implements_the_contract_member_by_member():
    view, _ = _view()
    assert isinstance(view, MethodRun)  # runtime_checkable: every member present
    for name in CONTRACT:
        declared, implemented = inspect.getattr_static(MethodRun, name), inspect.getattr_static(MethodView, name)
        if isinstance(declared, property):
            assert isinstance(implemented, property), f"MethodView.{name} must be a read-only property"
            declared, implemented = declared.fget, implemented.fget
        assert inspect.signature(implemented) == inspect.signature(declared), f"MethodView.{name} differs"


@pytest.mark.parametrize("dropped", sorted(CONTRACT))
def test_a_view_missing_a_member_is_not_a_method_run(dropped):
    """The check above can fail: a view without any one member is no `MethodRun`."""

    def member(name: str):
        if isinstance(inspect.getattr_static(MethodRun, name), property):
            return property(lambda self: object())
        return lambda self, *args: None

    def stand_in(members: set[str]) -> object:
        return type("StandIn", (), {name: member(name) for name in members})()

    assert isinstance(stand_in(CONTRACT), MethodRun)
    assert not isinstance(stand_in(CONTRACT - {dropped}), MethodRun)


def test_the_view_offers_a_method_nothing_beyond_the_contract():
    """No public member outside the contract: the noise streams, the ledger and the run stay out of reach."""
    public = {name for name in dir(MethodView) if not name.startswith("_")}
    assert public == CONTRACT
    view, _ = _view()
    assert {name for name in vars(view) if not name.startswith("_")} == set()


def _contract_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return {a.arg for a in arguments if isinstance(a.annotation, ast.Name) and a.annotation.id == "MethodRun"}


def test_every_method_uses_only_what_the_contract_declares():
    """Every function of every method folder that takes a `MethodRun` calls only its declared members on it."""
    checked = []
    for path in sorted(METHODS.rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = _contract_parameters(function)
            if not names or not function.body or path.name == "base.py":
                continue
            used = {
                node.attr
                for node in ast.walk(function)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names
            }
            assert used <= CONTRACT, f"{path.relative_to(METHODS)}:{function.name} uses {sorted(used - CONTRACT)}"
            checked.append(f"{path.parent.name}.{function.name}")
    assert "frost.before_step" in checked  # the check saw the one method that releases through its run


def test_a_release_is_noised_with_the_plans_sigma_and_recorded():
    view, seen = _view(sigma=2.0)
    noisy = view.release("selection", torch.zeros(3, dtype=torch.float16), sensitivity=0.5)
    assert seen["noise_std"] == [2.0 * 0.5] and seen["recorded"] == ["selection"]
    assert noisy.dtype == torch.float32 and torch.equal(noisy, torch.ones(3))
    assert "sigma" not in inspect.signature(MethodRun.release).parameters  # a method cannot name its own noise


@pytest.mark.parametrize("sensitivity", [0.0, -1.0, float("inf"), float("nan")])
def test_a_release_without_a_finite_positive_sensitivity_is_refused(sensitivity):
    view, seen = _view()
    with pytest.raises(ValueError, match="sensitivity"):
        view.release("selection", torch.zeros(2), sensitivity)
    assert seen["noise_std"] == [] and seen["recorded"] == []


def test_releases_count_the_current_ledger_and_an_engine_suspends_trainings():
    group = MechanismGroup(name="selection", noise_multiplier=1.0, sample_rate=0.5, steps=3)
    other = MechanismGroup(name="dp-sgd", noise_multiplier=1.0, sample_rate=0.5, steps=7)
    view, seen = _view(ledger_groups=[group, other, group])
    assert view.releases("selection") == 6 and view.releases("unplanned") == 0
    engine = view.new_engine(reducer=None)
    engine.detach()
    assert seen["suspended"] == 1
