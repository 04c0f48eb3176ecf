"""`LogicalBatchBoundaries`: the Trainer callback around every optimizer step of a private run.

A callback rather than a hook because Trainer's loop has no overridable method at a step's edges; it is added by the
mixin when the trainer is built and reads the trainer only through `PrivateSteps`.
"""

from __future__ import annotations

from typing import Any, Protocol

from transformers import TrainerCallback

from ..data.units import PrivacyUnits
from ..run.privacy_run import PrivacyRun
from .preflight import check_private_path_unchanged


class PrivateSteps(Protocol):
    """What the callback reads of the private trainer."""

    units: PrivacyUnits
    privacy_run: PrivacyRun
    _private_path: dict[str, Any]

    def _stop_for_budget(self) -> None: ...


class LogicalBatchBoundaries(TrainerCallback):
    """Trainer's hooks around every optimizer step.

    Begin: refuse a private-path method patched since the trainer was built (`preflight.check_private_path_unchanged`),
    and reset the engine, so an interrupted batch never joins the next. End: stop once the budget allows no
    further step, so the loop ends with global_step equal to the ledger's steps (not one empty step later).
    """

    def __init__(self, trainer: PrivateSteps) -> None:
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        check_private_path_unchanged(self.trainer, self.trainer._private_path)  # e.g. patched by a callback
        self.trainer.privacy_run.before_step()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer.privacy_run.may_step():
            self.trainer._stop_for_budget()
