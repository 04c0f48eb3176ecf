"""The privacy unit, chosen once from the method config: what the Poisson sampler draws, and how a drawn unit's
examples reach the trainer.

Three units share one interface (`PrivacyUnits`), so the trainer never asks which one it holds:

* `ExampleUnits`: every example is a unit (record-level DP). The sampler draws examples at rate q.
* `UserUnits` (ULS, `user_sampling="user"`): the sampler draws *users* at rate q, each with up to
  `examples_per_user` of their examples; every example is tagged with its user, so each collated batch says how many
  consecutive examples each user has (`users.UNIT_SIZES_KEY`) and no chunk splits a user.
* `CappedUserUnits` (ELS, `user_sampling="example"`): every user keeps at most `max_examples_per_user` examples,
  drawn once (`users.cap_examples`); the kept examples are then sampled as `ExampleUnits` samples examples. What the
  cap means for ε is the plan's business (`users.stages_for`), not the sampler's.

As JAX-Privacy's `UserSelectionStrategy` wraps a batch-selection strategy, a user unit is a sampling design on top of
the example sampler: `units_for` makes the choice once, when the trainer is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import Sampler, Subset

from ..privacy.rng import SecretRandom
from .chunks import unit_slices
from .packing import packs
from .sampling import PoissonBatchSampler, chunk_lengths
from .users import UnitCollator, UnitTagged, UserIndex, UserPoissonSampler, capped_size, run_lengths

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["CappedUserUnits", "ExampleUnits", "PrivacyUnits", "UserUnits", "units_for"]

#: ELS: the rows of the training set every user keeps, drawn once by the run (`PrivacyRun.kept_by_users`)
Cap = Callable[[UserIndex], np.ndarray]


class UnitConfig(Protocol):
    """The unit fields of a method config (`hf_private.methods.MethodConfig`) that choose the unit."""

    privacy_unit: str
    user_column: str | None
    user_sampling: str
    examples_per_user: int


class PrivacyUnits:
    """The privacy unit's data path, as the trainer uses it. `users`: the training set's users (None when the unit
    is an example).

    Written for the example unit (`ExampleUnits` adds nothing); a unit changes what the sampler draws
    (`poisson_sampler`), how many consecutive examples each drawn unit has (`unit_sizes`, `in_unit_order`), or what
    the sampler draws from (`training_view`). `poisson_sample` is the same for every unit.
    """

    users: UserIndex | None = None

    def __init__(self, args: TrainingArguments) -> None:
        self.args = args  # where this process's chunks go (process_index, world_size, per_device_train_batch_size)

    def training_view(self, dataset: Any, collate: Callable) -> tuple[Any, Callable]:
        """The set the sampler draws from and its collator, from the training set as the model reads it and its
        empty-batch-safe collator."""
        return dataset, collate

    def poisson_sampler(
        self,
        view: Any,
        sample_rate: float,
        steps: int,
        num_chunks: int,
        random: SecretRandom,
        lengths: torch.Tensor | None = None,
    ) -> Sampler[list[int]]:
        """`steps` Poisson logical batches of units at `sample_rate`, each yielded as `num_chunks` index lists into
        `view` (this process's shard), a unit's examples consecutive; with `lengths`, each batch ordered by length."""
        return PoissonBatchSampler(
            len(view),
            sample_rate,
            steps,
            num_chunks,
            rank=self.args.process_index,
            world_size=self.args.world_size,
            random=random,
            lengths=lengths,
        )

    def chunk_lengths(self, source: Any, processing_class: Any, view: Any, collate: Callable) -> torch.Tensor | None:
        """One length per example of `source` (the trainer's training set) when chunks are sorted by length:
        group_by_length, or packed chunks (`sampling.chunk_lengths`); None otherwise."""
        packed = len(view) >= 2 and packs(collate, view)
        return chunk_lengths(self.args, source, processing_class, packed=packed)

    def unit_sizes(self, indices: list[int]) -> list[int]:
        """How many consecutive examples each unit of a drawn index list has."""
        return [1] * len(indices)

    def in_unit_order(self, indices: list[int]) -> list[int]:
        """`indices` with each unit's examples consecutive, as the sampler keeps them (for the independence probe)."""
        return indices

    def examples_per_batch(self, sample_rate: float, expected_batch_size: float) -> float:
        """Training examples a logical batch holds in expectation: the logged loss's denominator (a mean per
        example)."""
        return expected_batch_size

    def poisson_sample(self, view: Any, sample_rate: float, random: SecretRandom) -> list[list[int]]:
        """This process's share of one Poisson sample of units at `sample_rate` (a method's own release, e.g.
        DP-FROST's selection), as indices into `view` in physical chunks of at most per_device_train_batch_size whole
        units."""
        indices = next(iter(self.poisson_sampler(view, sample_rate, 1, 1, random)))
        chunks = unit_slices(self.unit_sizes(indices), self.args.per_device_train_batch_size)
        return [indices[start:stop] for start, stop, _ in chunks]


class ExampleUnits(PrivacyUnits):
    """Every example is a privacy unit: the sampler draws examples at rate q (record-level DP)."""


class CappedUserUnits(ExampleUnits):
    """ELS: examples sampled as `ExampleUnits` does, from the at most `max_examples_per_user` each user keeps."""

    users: UserIndex

    def __init__(self, args: TrainingArguments, users: UserIndex, cap: Cap) -> None:
        super().__init__(args)
        self.users, self._cap = users, cap

    def training_view(self, dataset: Any, collate: Callable) -> tuple[Any, Callable]:
        """The examples every user keeps (the run draws them once; on resume, found by content: `data.user_cap`)."""
        kept = self._cap(self.users)
        return (dataset.select(kept) if hasattr(dataset, "select") else Subset(dataset, kept.tolist())), collate

    def chunk_lengths(self, source: Any, processing_class: Any, view: Any, collate: Callable) -> torch.Tensor | None:
        """The lengths of the kept examples: the sampler draws from the view, not from the whole training set."""
        lengths = super().chunk_lengths(source, processing_class, view, collate)
        return None if lengths is None else lengths[torch.as_tensor(self._cap(self.users), dtype=torch.long)]


class UserUnits(PrivacyUnits):
    """ULS: the sampler draws users at rate q, each with up to `examples_per_user` of their examples, consecutive and
    tagged with their user, so the engine sums a user's examples into one term and clips it."""

    users: UserIndex

    def __init__(self, args: TrainingArguments, users: UserIndex, examples_per_user: int) -> None:
        super().__init__(args)
        self.users, self.examples_per_user = users, examples_per_user

    def training_view(self, dataset: Any, collate: Callable) -> tuple[Any, Callable]:
        """Each example tagged with its user, and each batch told how many examples each of its users has."""
        return UnitTagged(dataset, self.users.user_of), UnitCollator(collate)

    def poisson_sampler(
        self,
        view: Any,
        sample_rate: float,
        steps: int,
        num_chunks: int,
        random: SecretRandom,
        lengths: torch.Tensor | None = None,
    ) -> Sampler[list[int]]:
        """Poisson batches of users (q over users); `lengths` is not read: a chunk holds whole users."""
        return UserPoissonSampler(
            self.users,
            sample_rate,
            steps,
            self.examples_per_user,
            num_chunks,
            rank=self.args.process_index,
            world_size=self.args.world_size,
            random=random,
        )

    def chunk_lengths(self, source: Any, processing_class: Any, view: Any, collate: Callable) -> torch.Tensor | None:
        """None: chunks hold whole users, never examples sorted by length."""
        return None

    def unit_sizes(self, indices: list[int]) -> list[int]:
        return run_lengths(self.users.user_of[indices].tolist())

    def in_unit_order(self, indices: list[int]) -> list[int]:
        return sorted(indices, key=lambda i: self.users.user_of[i])

    def examples_per_batch(self, sample_rate: float, expected_batch_size: float) -> float:
        """q·Σ_u min(n_u, k): a sampled user brings up to k examples."""
        return sample_rate * capped_size(self.users, self.examples_per_user)


def units_for(
    config: UnitConfig, args: TrainingArguments, training_set: Any, cap: Cap, users: UserIndex | None = None
) -> PrivacyUnits:
    """The privacy unit `config` asks for, chosen once. At user level the users of `training_set` (the training set
    as the trainer holds it): `users` when they were already read from this very set, else read here (TRL tokenizes,
    and may drop rows). `cap` draws the ELS cap when the training view is first built."""
    if config.privacy_unit != "user":
        return ExampleUnits(args)
    assert config.user_column is not None  # `users.check_privacy_unit`: the user level names its column
    users = users if users is not None else UserIndex.of(training_set, config.user_column)
    if config.user_sampling == "user":
        return UserUnits(args, users, config.examples_per_user)
    return CappedUserUnits(args, users, cap)
