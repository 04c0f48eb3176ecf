"""The run's privacy state under the trainer's public names (`trainer.plan` is `trainer.privacy_run.plan`).

The run (`run.privacy_run.PrivacyRun`) owns the state; the trainer only names it, so a user reads `trainer.ledger`
or calls `trainer.privacy_report()` as before the run was split from the trainer, and there is one copy of each fact.
"""

from __future__ import annotations

from typing import Any


class _FromRun:
    """A trainer attribute that is the privacy run's own (`trainer.privacy_run`), under the trainer's public name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.privacy_run, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.privacy_run, self.name, value)


class RunAttributes:
    """The run's state and actions, each a `_FromRun` under the trainer's public name (the mixin inherits this)."""

    (
        plan,
        ledger,
        engine,
        stage,
        delta,
        expected_batch_size,
        sample_rate,
        steps_per_epoch,
        planned_steps,
        noise_multiplier,
        mechanism_name,
        has_formal_guarantee,
        training_steps,
        trained_parameter_names,
        record_release,
        suspend_training_engine,
        privacy_report,
        attach_audit,
        audit,
    ) = (_FromRun() for _ in range(19))
