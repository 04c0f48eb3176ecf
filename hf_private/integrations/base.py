"""What `privatize()` must know about a family of Trainers: one interface, one instance per family.

A family is a Trainer class and its subclasses that train the same kind of unit the same way (`transformers.Trainer`
on examples, TRL's `SFTTrainer` on sequences, later `DPOTrainer` on preference pairs). The private path itself never
changes; a family tells it:

* the privacy unit, as the report, the ledger and the card name it ("example", "conversation", "preference pair");
* how many consecutive rows of a collated chunk make one unit (DPO: 2, chosen then rejected), so the engine clips the
  unit, not each row;
* the per-unit training loss used when the user gives no `per_example_loss`: each unit's own loss, never a batch
  share of it;
* which of the family's own methods on the private training path are compatible with it, and why;
* the family's own settings that would change what is clipped or publish un-noised data: refused by name, with the
  reason and the fix (`hf_private.preflight` raises; the family only declares them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from ..example_rows import rows_per_example
from ..losses import PerExampleLoss, default_per_example_loss


@dataclass(frozen=True)
class RefusedSetting:
    """A family setting the private path cannot honour: `name` as the user writes it, `is_on(args, model)` whether
    this run turns it on, and `reason`: why, and what to do instead."""

    name: str
    is_on: Callable[[Any, nn.Module], bool]
    reason: str


@dataclass(frozen=True)
class RefusedKeyword:
    """A trainer keyword of the family the private path cannot honour with this DP method: `is_refused(value,
    dp_config)` decides, `reason` says why and what to do."""

    name: str
    is_refused: Callable[[Any, Any], bool]
    reason: str


class TrainerFamily:
    """The defaults are `transformers.Trainer`'s: one example per unit, the head's own per-example loss."""

    #: how the report and the card name the family's trainer
    name = "transformers.Trainer"
    #: dotted names (module.qualname) of the family's own classes: their overrides are the family's, not a user's
    own_classes: tuple[str, ...] = ("transformers.trainer.Trainer",)
    #: the family's own overrides of methods on the private training path, each with why it is compatible
    compatible_overrides: Mapping[str, str] = {}
    refused_settings: tuple[RefusedSetting, ...] = ()
    refused_keywords: tuple[RefusedKeyword, ...] = ()

    def unit(self, train_dataset: Any) -> str:
        """The privacy unit, as "one training <unit>" reads on the card."""
        return "example"

    def rows_per_unit(self, model: nn.Module, inputs: Mapping[str, Any]) -> int:
        """Consecutive rows of a collated chunk that belong to one unit (the engine clips their sum)."""
        return rows_per_example(model, inputs)

    def per_unit_loss(self, args: Any) -> PerExampleLoss:
        """ℓ_u(model, outputs, labels) → one loss per unit, when the user passes no `per_example_loss`."""
        return partial(default_per_example_loss, label_smoothing=args.label_smoothing_factor)

    def owns(self, cls: type) -> bool:
        return dotted_name(cls) in self.own_classes


def dotted_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
