"""The ε column of the training logs (review item 7): non-decreasing, never below the ε spent at its step, and the
exact ε at the end, within a cost budget (`hf_private.privacy.epsilon_log`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
from transformers import TrainerCallback

from hf_private import BitFitConfig, DPConfig, FrostConfig
from hf_private import run as run_module
from hf_private.privacy import PrivacyLedger, compute_epsilon
from hf_private.privacy import ledger as ledger_module
from hf_private.privacy.epsilon_log import EpsilonLog
from tests import tiny
from tests.helpers import make_trainer

N, DELTA = 10_000, 1e-5


def _exact_after(ledger: PrivacyLedger, training: set[str], steps: int) -> float:
    """ε of what the ledger held after `steps` training steps, recomputed in a fresh ledger (a method's own releases
    recorded before the next training step are not yet in)."""
    fresh = PrivacyLedger(ledger.dataset_size, ledger.delta, ledger.accountant)
    done = 0
    for group in ledger.mechanisms:
        if done == steps:
            break
        take = min(group.steps, steps - done) if group.name in training else group.steps
        fresh.record_event(dataclasses.replace(group, steps=take))
        done += take if group.name in training else 0
    return fresh.epsilon()


def _check_column(trainer) -> list[float]:
    """The three properties on a trained run's log history; the logged column."""
    lines = [entry for entry in trainer.state.log_history if "loss" in entry]
    logged = [entry["epsilon"] for entry in lines]
    final = [entry for entry in trainer.state.log_history if "train_loss" in entry][-1]["epsilon"]
    assert logged and logged == sorted(logged)
    assert logged[-1] <= final == trainer.privacy_report()["epsilon"]
    training = {stage.name for stage in trainer.plan.training_stages}
    for entry in lines:
        assert entry["epsilon"] >= _exact_after(trainer.ledger, training, entry["step"]), entry
    return logged


def _accountant_calls(monkeypatch) -> list[int]:
    """Count the ledger's accountant evaluations: the releases each composed."""
    calls: list[int] = []
    inner = ledger_module.epsilon_bound

    def counting(mechanisms, delta, accountant):
        calls.append(sum(group.steps for group in mechanisms))
        return inner(mechanisms, delta, accountant)

    monkeypatch.setattr(ledger_module, "epsilon_bound", counting)
    return calls


def _with_share(monkeypatch, share: float) -> None:
    """The run's EpsilonLog with a cost share: 0 makes every evaluation after the first look as far as allowed."""
    monkeypatch.setattr(run_module, "EpsilonLog", functools.partial(EpsilonLog, share=share))


# ---------------------------------------------------------------------- through the trainer
@pytest.mark.parametrize("share", [0.0, None], ids=["no-budget", "default-budget"])
def test_a_run_logs_a_non_decreasing_epsilon_that_bounds_the_spent_one_and_ends_exact(tmp_path, monkeypatch, share):
    if share is not None:
        _with_share(monkeypatch, share)
    calls = _accountant_calls(monkeypatch)
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=10)
    trainer.train()
    evaluated = list(calls)
    logged = _check_column(trainer)
    assert len(logged) == 10
    if share == 0.0:  # exact after step 1 (which measures the cost), then one look-ahead to the end, reused
        assert evaluated == [1, 10] and logged[1:] == [logged[-1]] * 9 and logged[0] < logged[-1]


def test_a_log_line_never_looks_past_the_end_of_the_run(tmp_path):
    """The review's case: the last line before the end (step 10 of 12) must not be an ε of 15 steps."""
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=12,
                           logging_steps=5)
    trainer.train()
    logged = _check_column(trainer)
    assert len(logged) == 2 and logged[-1] <= trainer.ledger.epsilon()


def test_two_stages_never_share_a_look_ahead(tmp_path, monkeypatch):
    """1+BiTFiT: the look-ahead of full fine-tuning stops at its last step; DP-BiTFiT's starts after it."""
    _with_share(monkeypatch, 0.0)
    calls = _accountant_calls(monkeypatch)
    trainer = make_trainer(tmp_path, dp=BitFitConfig(noise_multiplier=1.0, full_finetune_epochs=1),
                           per_device_train_batch_size=24, num_train_epochs=3)
    assert trainer.plan.start_steps == {"dp-sgd": 0, "dp-bitfit": 4} and trainer.planned_steps == 12
    trainer.train()
    assert calls == [1, 4, 12]  # exact at 1, ahead to the end of full fine-tuning, then to the end of the run
    _check_column(trainer)


def test_a_budget_stop_ends_the_column_at_the_exact_epsilon(tmp_path, monkeypatch):
    _with_share(monkeypatch, 0.0)
    trainer = make_trainer(tmp_path, dp=DPConfig(target_epsilon=2.0), max_steps=4)
    trainer.args.max_steps = 40  # asks for ten times the calibrated plan: the budget stops it
    trainer.train()
    logged = _check_column(trainer)
    assert 4 <= trainer.training_steps() < 40 and logged[-1] == trainer.privacy_report()["epsilon"] <= 2.0


def test_dp_frost_never_looks_ahead_across_a_selection(tmp_path, monkeypatch):
    _with_share(monkeypatch, 0.0)
    dp = FrostConfig(noise_multiplier=0.8, max_grad_norm=1.0, unfreeze_ratio=0.3, selection_sample_rate=0.25,
                     num_selections=2)  # no test seed: a run with a guarantee logs ε
    trainer = make_trainer(tmp_path, model=tiny.bert(), dp=dp, dataset=tiny.sentiment_dataset(200),
                           per_device_train_batch_size=16, max_steps=12)
    trainer.train()
    _check_column(trainer)
    assert len(trainer.dp_method.selections) == 2


def test_a_run_stopped_early_ends_exact_and_says_the_last_line_was_ahead(tmp_path, monkeypatch, caplog):
    _with_share(monkeypatch, 0.0)
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=10)
    trainer.add_callback(_StopAt(4))
    with caplog.at_level("INFO", logger="transformers.hf_private.privacy.epsilon_log"):
        trainer.train()
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "loss" in entry]
    final = trainer.state.log_history[-1]["epsilon"]
    assert trainer.training_steps() == 4 and final == trainer.privacy_report()["epsilon"] < logged[-1]
    assert "upper bound for steps the run did not reach" in caplog.text


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


# ---------------------------------------------------------------------- the cost budget, on a fake clock
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _costly_accountant(monkeypatch, clock: _Clock, seconds: float) -> list[int]:
    """The ledger's accountant taking `seconds` × √(steps composed) on `clock`, about as PRV's does; returns the
    list of the steps of each evaluation."""
    calls = _accountant_calls(monkeypatch)
    counting = ledger_module.epsilon_bound

    def costly(mechanisms, delta, accountant):
        clock.now += seconds * math.sqrt(sum(group.steps for group in mechanisms))
        return counting(mechanisms, delta, accountant)

    monkeypatch.setattr(ledger_module, "epsilon_bound", costly)
    return calls


def _simulate(monkeypatch, cost: float, steps: int = 300, every: int = 1) -> tuple[list[float], list[float], int,
                                                                                  EpsilonLog]:
    """A run of one mechanism, one second per step, a log line every `every` steps: (logged, exact ε at each logged
    step and at the end, accountant evaluations, the EpsilonLog)."""
    clock = _Clock()
    calls = _costly_accountant(monkeypatch, clock, cost)
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    log = EpsilonLog(ledger, 0, clock=clock)
    logged, exact = [], []
    for t in range(1, steps + 1):
        clock.now += 1.0
        ledger.record("dp-sgd", 1.0, 0.01, max_grad_norm=1.0)
        if t % every == 0:
            logged.append(log.at_step(t, steps, steps))
            exact.append(compute_epsilon(ledger.mechanisms, DELTA, "rdp"))
    logged.append(log.final())
    exact.append(compute_epsilon(ledger.mechanisms, DELTA, "rdp"))
    return logged, exact, len(calls), log


@pytest.mark.parametrize("every", [1, 7])
def test_an_expensive_accountant_is_called_a_few_times_within_budget_and_the_column_holds(monkeypatch, every):
    # 0.1 s × √steps: the exact ε on every line would take ~350 s (every=1), the budget is 2% of 300 s
    logged, exact, evaluations, log = _simulate(monkeypatch, cost=0.1, every=every)
    assert logged == sorted(logged) and logged[-1] == exact[-1]
    assert all(value >= spent for value, spent in zip(logged, exact))
    assert evaluations <= 10 and log.accountant_seconds <= 0.02 * log.training_seconds()


@pytest.mark.parametrize("every", [1, 7])
def test_a_cheap_accountant_gives_the_exact_epsilon_on_every_line(monkeypatch, every):
    logged, exact, evaluations, _ = _simulate(monkeypatch, cost=1e-4, every=every)
    assert logged == exact and evaluations == math.ceil(300 / every)  # every line, and the final one off a line


@pytest.mark.parametrize(("cost", "cap", "horizon"), [
    (1e-4, 1000, 11),  # ~2e5 units: the exact ε on all 990 lines left (~2.1e4) is affordable
    (0.01, 1000, 12),  # ~2000 units: 157 evaluations at 11·(1000/11)^(k/157), the first at 11.3
    (0.1, 1000, 16), (0.1, 15, 15),  # ~197 units: 14 evaluations, the first at 15.2 (or the cap)
    (1.0, 1000, 1000), (1.0, 500, 500),  # ~17 units: not even 2 evaluations, so straight to the end (or the cap)
])
def test_a_look_ahead_spaces_the_affordable_evaluations_to_reach_the_end(monkeypatch, cost, cap, horizon):
    """After 11 steps of 1000 at one second each, the first line (at 10 steps) having cost `cost`·√10 s, 2% leaves
    (20 − cost·√10) s, in units of an evaluation at one step 20/cost − √10: the most evaluations at t·r, t·r², …,
    1000 (costing Σ √(t·r^k) units) within it."""
    clock = _Clock()
    calls = _costly_accountant(monkeypatch, clock, cost)
    ledger = PrivacyLedger(N, DELTA, accountant="rdp")
    log = EpsilonLog(ledger, 0, clock=clock)
    ledger.record("dp-sgd", 1.0, 0.01, steps=10)
    clock.now = 10.0
    log.at_step(10, cap, 1000)  # the first line is exact and measures the cost
    ledger.record("dp-sgd", 1.0, 0.01)
    clock.now += 1.0
    log.at_step(11, cap, 1000)
    assert calls == [10, horizon]
