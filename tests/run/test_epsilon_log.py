"""The ε column of the training logs: at every logging step the ε the steps taken have spent (the ledger's, as
`privacy_report()` gives it then), never a bound for steps not yet taken; non-decreasing; the exact final ε at the
end (issue 45: a look-ahead logged 2.995 at step 10 of 32 while the report said 2.51 at step 20)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainerCallback

from hf_private import BitFitConfig, DPConfig, FrostConfig
from hf_private.privacy import PrivacyLedger
from tests.support import tiny
from tests.support.helpers import make_trainer


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


class _Report(TrainerCallback):
    """`privacy_report()["epsilon"]` at each logging step, as a user's callback would read it."""

    def __init__(self) -> None:
        self.trainer = None
        self.epsilons: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.epsilons[state.global_step] = self.trainer.privacy_report()["epsilon"]


def _train_and_check(trainer) -> list[float]:
    """Train; every logged ε is the ε spent at its step (the report's then, and recomputed from the ledger), the column
    never decreases, and the final metrics give the report's ε. The logged column."""
    report = _Report()
    report.trainer = trainer
    trainer.add_callback(report)
    trainer.train()
    lines = [entry for entry in trainer.state.log_history if "loss" in entry]
    logged = [entry["epsilon"] for entry in lines]
    assert logged and logged == sorted(logged)
    training = {stage.name for stage in trainer.plan.training_stages}
    for entry in lines:
        assert entry["epsilon"] == pytest.approx(_exact_after(trainer.ledger, training, entry["step"]), rel=1e-9)
        assert entry["epsilon"] == report.epsilons[entry["step"]]
    final = [entry for entry in trainer.state.log_history if "train_loss" in entry][-1]["epsilon"]
    assert logged[-1] <= final == trainer.privacy_report()["epsilon"]
    return logged


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_each_logging_step_logs_the_epsilon_spent_so_far(tmp_path, accountant):
    """Fails on the look-ahead: every line after the first there carried the ε of a later step."""
    trainer = make_trainer(
        tmp_path,
        dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, accountant=accountant),
        max_steps=12,
        logging_steps=3,
    )
    logged = _train_and_check(trainer)
    assert len(logged) == 4 and logged[0] < logged[-1] == trainer.ledger.epsilon()


def test_two_stages_log_the_epsilon_spent_in_each(tmp_path):
    trainer = make_trainer(
        tmp_path,
        dp=BitFitConfig(noise_multiplier=1.0, full_finetune_epochs=1),
        per_device_train_batch_size=24,
        num_train_epochs=3,
    )
    assert trainer.plan.start_steps == {"dp-sgd": 0, "dp-bitfit": 4} and trainer.planned_steps == 12
    assert len(_train_and_check(trainer)) == 12


def test_dp_frost_logs_the_epsilon_of_the_selections_made_and_the_steps_taken(tmp_path):
    dp = FrostConfig(
        noise_multiplier=0.8, max_grad_norm=1.0, unfreeze_ratio=0.3, selection_sample_rate=0.25, num_selections=2
    )  # no test seed: a run with a guarantee logs ε
    trainer = make_trainer(
        tmp_path,
        model=tiny.bert(),
        dp=dp,
        dataset=tiny.sentiment_dataset(200),
        per_device_train_batch_size=16,
        max_steps=12,
    )
    _train_and_check(trainer)
    assert len(trainer.dp_method.selections) == 2


def test_a_budget_stop_ends_the_column_at_the_exact_epsilon(tmp_path):
    trainer = make_trainer(tmp_path, dp=DPConfig(target_epsilon=2.0), max_steps=4)
    trainer.args.max_steps = 40  # asks for ten times the calibrated plan: the budget stops it
    logged = _train_and_check(trainer)
    assert 4 <= trainer.training_steps() < 40 and logged[-1] == trainer.privacy_report()["epsilon"] <= 2.0


def test_a_run_stopped_early_never_logged_more_than_it_spent(tmp_path):
    trainer = make_trainer(tmp_path, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=10)
    trainer.add_callback(_StopAt(4))
    logged = _train_and_check(trainer)
    assert trainer.training_steps() == 4 and logged[-1] == trainer.privacy_report()["epsilon"]


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step
