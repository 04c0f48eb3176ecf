"""Trainer's evaluation hooks for a private run (`EvaluationHooks`): which metrics the card may call held-out.

A metric computed on training rows (the training set itself, or its rows in another guise) is not a held-out
result; the verdict is made on the very set each evaluation reads, as the class's `evaluate` prepared it
(`evaluation.held_out`), and held-out predictions that collapse to one class are warned about.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.data import DataLoader

if TYPE_CHECKING:  # type checkers read the hooks as the Trainer methods they override
    from transformers import Trainer as _Trainer

    from ..evaluation.held_out import Evaluations
    from ..run.privacy_run import PrivacyRun
else:
    _Trainer = object


class EvaluationHooks(_Trainer):
    """Trainer's `evaluate` and `get_eval_dataloader` for a private trainer: placed after `PrivateTrainingMixin` in
    the MRO (the mixin inherits it), so `super()` is the Trainer class. Reads the mixin's `privacy_run` and
    `_evaluations`."""

    privacy_run: PrivacyRun
    _evaluations: Evaluations
    model: nn.Module  # never None: the mixin refuses a missing model and model_init before Trainer is built

    def _set_read(self, eval_dataset: Any) -> Any:
        """The set an evaluation reads: `eval_dataset`, else the trainer's; a name is an entry of the trainer's dict
        of sets (Trainer's evaluate recurses over a dict under the names of its entries)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(dataset, str):
            return dataset
        assert isinstance(self.eval_dataset, dict), "only a dict of evaluation sets names its sets"
        return self.eval_dataset[dataset]

    def evaluate(
        self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval", **kwargs: Any
    ) -> dict[str, float]:
        """The class's evaluate, recording its metrics and whether the card may call them held-out.

        Only metrics computed here reach the card, each with the verdict on the very set that produced it (a dict
        of sets recurses here once per set, under the prefix eval_<name>).
        """
        dataset = self._set_read(eval_dataset)
        if isinstance(dataset, dict) or dataset is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        metrics = self._evaluations.record(
            metric_key_prefix, partial(super().evaluate, eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        )
        settings = self.privacy_run.collapse_settings(self.args.learning_rate)
        self._evaluations.predictions.warn_if_collapsed(
            metric_key_prefix,
            self.model,
            settings,
            reduce=(partial(self.accelerator.reduce, reduction="sum") if self.args.world_size > 1 else None),
        )
        return metrics

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Trainer's, once the set it reads is judged held out or not (`held_out.Evaluations.reading`): here the set
        is as the class's evaluate prepared it (TRL tokenizes, appends an EOS to and packs a set passed to evaluate)."""
        dataset = self._set_read(eval_dataset)
        if dataset is not None:
            self._evaluations.reading(dataset)
        return super().get_eval_dataloader(eval_dataset)
