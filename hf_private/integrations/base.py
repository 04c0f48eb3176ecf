"""What `privatize()` must know about a family of Trainers: one interface, one instance per family.

A family is a Trainer class and its subclasses that train the same kind of unit the same way (`transformers.Trainer`
on examples, TRL's `SFTTrainer` on sequences, later `DPOTrainer` on preference pairs). The private path itself never
changes; a family tells it:

* the privacy unit, as the report, the ledger and the card name it ("example", "conversation", "preference pair");
* how many consecutive rows of a collated chunk make one unit (DPO: 2, chosen then rejected), so the engine clips the
  unit, not each row;
* how the training chunks are collated (DPO: each pair's chosen and rejected rows stacked) and each unit's loss
  computed from a chunk: each unit's own loss, never a batch share of it (`per_unit_loss` when the user gives no
  `per_example_loss`, for the families whose loss reads the model's outputs and the labels);
* which of the family's own methods on the private training path are compatible with it, and why;
* the family's own settings that would change what is clipped or publish un-noised data: refused by name, with the
  reason and the fix (`hf_private.trainer.preflight` raises; the family only declares them);
* what its training data must hold: the columns its trainer prepares from (`check_columns`, before the trainer is
  built) and the entry of a collated batch the per-unit loss reads the labels from (`labels_entry`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..data.packing import PACKED_LENGTHS_KEY, PACKED_ROWS_KEY, packed_layout
from ..data.rows import rows_per_example
from ..models.support import is_causal_lm, with_decoder_inputs
from .losses import PerExampleLoss, check_packed_head, default_per_example_loss, packed_causal_lm_losses


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
    #: whether a user's `per_example_loss(model, outputs, labels)` can be the unit's loss (not for a pair loss)
    accepts_per_example_loss = True
    #: columns the trainer computes from each unit (not what the unit is): the held-out check leaves them out
    derived_columns: tuple[str, ...] = ()
    #: the entry of a collated training batch that `unit_losses` reads the labels from (None: it reads none)
    labels_entry: str | None = "labels"

    def check_columns(self, train_dataset: Any, args: Any, trainer_kwargs: Mapping[str, Any]) -> None:
        """Refuse a training set the family's trainer cannot prepare, naming the columns found and those expected;
        called before the trainer is built (Trainer prepares nothing: its labels are checked on a collated batch)."""

    def unit(self, train_dataset: Any) -> str:
        """The privacy unit, as "one training <unit>" reads on the card."""
        return "example"

    def rows_per_unit(self, model: nn.Module, inputs: Mapping[str, Any]) -> int:
        """Consecutive rows of a collated chunk that belong to one unit (the engine clips their sum)."""
        return rows_per_example(model, inputs)

    def per_unit_loss(self, args: Any) -> PerExampleLoss | None:
        """ℓ_u(model, outputs, labels) → one loss per unit, when the user passes no `per_example_loss` (None: the
        family's `unit_losses` does not read one)."""
        return partial(default_per_example_loss, label_smoothing=args.label_smoothing_factor)

    def training_set(self, dataset: Any, args: Any) -> Any:
        """The training set as the trainer prepared it, one unit per row: a family undoes a preparation that put
        several units in one row (TRL's dataset packing), so that the sampler draws units."""
        return dataset

    def unmarked_units(self, args: Any) -> str | None:
        """Why a row the trainer prepares for evaluation may hold parts of units that nothing in it delimits (the
        held-out check then cannot clear it); None: each row holds whole units, several only with `seq_lengths` or
        restarting `position_ids` (`hf_private.evaluation.row_identity`)."""
        return None

    def training_collator(self, collate_fn: Callable[[list], Mapping[str, Any]]) -> Callable:
        """How a training chunk is collated: the trainer's own collator, unless the family regroups the rows."""
        return collate_fn

    def unit_losses(self, trainer: Any, model: nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
        """One loss per unit of a training chunk and the model's outputs: `trainer.per_example_loss` of the outputs
        and the labels."""
        if "labels" not in inputs:
            raise ValueError(f"Training batches need a 'labels' entry; got keys {sorted(inputs)}.")
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        layout = packed_layout(inputs)
        if layout is None:
            outputs = model(**with_decoder_inputs(model, inputs, labels))
            return trainer.per_example_loss(model, outputs, labels), outputs
        inputs.pop(PACKED_LENGTHS_KEY)
        inputs.pop(PACKED_ROWS_KEY, None)
        if not is_causal_lm(model):  # a head that separates packed sentences itself (hf_private's mean-pooled ones)
            outputs = model(**inputs)
            check_packed_head(model, outputs, labels, layout.examples)
            return trainer.per_example_loss(model, outputs, labels), outputs
        if trainer.custom_per_example_loss:
            raise ValueError(
                "per_example_loss(model, outputs, labels) cannot say which packed example each token "
                "belongs to: drop it (each packed example's loss is then its mean over its own trained "
                "tokens) or pad each example to a row of its own."
            )
        # without a cache transformers builds the block-diagonal mask from the restarting position_ids (with one,
        # the default in a model's config, it does not, and packed examples would attend to each other)
        outputs = model(**inputs, use_cache=False)
        return packed_causal_lm_losses(outputs.logits, labels, layout, trainer.args.label_smoothing_factor), outputs

    def owns(self, cls: type) -> bool:
        return dotted_name(cls) in self.own_classes


def dotted_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
