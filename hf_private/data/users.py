"""User-level DP: a whole person is the privacy unit, not one of their records.

Real private data comes in people (a patient's notes, a customer's chats): record-level ε says little about someone
with 200 records. At `privacy_unit="user"` the training set's `user_column` names each example's user, and one of two
sound designs (Charles et al. 2024, arXiv 2407.07737) bounds what one user can change:

* **ULS** (`user_sampling="user"`, the default): each step Poisson-samples *users* at rate q = B / users; a sampled
  user contributes the sum of the gradients of up to `examples_per_user` of their examples, drawn with the secret
  sampler, clipped as a whole to C. The engine clips the user's summed term, as it clips a multiple-choice example's
  rows; a user's examples are always computed in one chunk on one process, so their sum is one term. Noise and
  accounting are DP-SGD's, over users.
* **ELS** (`user_sampling="example"`): each user's examples are capped at `max_examples_per_user` once, before
  training (which ones, drawn secretly); examples are Poisson-sampled and clipped per example, and ε is accounted
  for a user who can have that many examples in a batch.

Here: the rules on the config's unit fields, the index of users in a training set, the ULS sampler, and the tags that
carry each example's user from the sampler to the trainer (`UnitTagged` → `UnitCollator` → `unit_sizes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..privacy.rng import SecretRandom

USER_SAMPLING = {"user": "ULS", "example": "ELS"}
#: the key a tagged training example carries its user under (never reaches the collator or the model)
UNIT_KEY = "__hf_private_unit__"
#: the collated batch's entry listing how many consecutive examples each unit of the batch has
UNIT_SIZES_KEY = "unit_sizes"


def check_privacy_unit(config: Any) -> None:
    """The unit fields of a DP config: a user column only at user level, and each design's own knob only with it."""
    unit, column, sampling = config.privacy_unit, config.user_column, config.user_sampling
    if unit not in ("example", "user"):
        raise ValueError(f"privacy_unit must be 'example' or 'user', got {unit!r}.")
    if unit == "example":
        if column is not None:
            raise ValueError(
                f"user_column={column!r} is set but privacy_unit='example': the guarantee would be per example, and "
                "a user with many examples would be protected only at about k·ε. Set privacy_unit='user' for a "
                "guarantee per person, or drop user_column."
            )
        return
    if not isinstance(column, str) or not column:
        raise ValueError(
            "privacy_unit='user' needs user_column: the training set's column naming each example's "
            "user (e.g. user_column='user_id')."
        )
    if sampling not in USER_SAMPLING:
        raise ValueError(f"user_sampling must be 'user' (ULS) or 'example' (ELS), got {sampling!r}.")
    if sampling == "user":
        if (
            isinstance(config.examples_per_user, bool)
            or not isinstance(config.examples_per_user, int)
            or config.examples_per_user < 1
        ):
            raise ValueError(f"examples_per_user must be an integer >= 1, got {config.examples_per_user!r}.")
        if config.max_examples_per_user is not None:
            raise ValueError(
                "max_examples_per_user is ELS's cap (user_sampling='example'); ULS draws up to "
                "examples_per_user of a sampled user's examples each step. Set one of them."
            )
    else:
        k = config.max_examples_per_user
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                "user_sampling='example' (ELS) needs max_examples_per_user, an integer >= 1: every user "
                f"keeps at most that many examples and ε is accounted for them; got {k!r}."
            )
        if config.examples_per_user != 1:
            raise ValueError(
                "examples_per_user is ULS's (user_sampling='user'); ELS caps users with "
                "max_examples_per_user. Set one of them."
            )


def user_level_facts(config: Any) -> dict[str, Any]:
    """What the report, the ledger and the card say about the unit at user level (nothing at example level)."""
    if config.privacy_unit != "user":
        return {}
    facts: dict[str, Any] = {"user_column": config.user_column, "user_sampling": config.user_sampling}
    if config.user_sampling == "user":
        facts["examples_per_user"] = config.examples_per_user
    else:
        facts["max_examples_per_user"] = config.max_examples_per_user
    return facts


# ---------------------------------------------------------------------- who wrote what
def user_ids(dataset: Any, column: str) -> list[int | str]:
    """Each example's user, as `plain_user_ids` reads it: the one reading of a user column (the index of users, so
    ULS, ELS, the probe and resume; the audit's new users). A `datasets.Dataset` is read as stored, its format (and
    any transform) aside: the ids are metadata, never model inputs."""
    names = getattr(dataset, "column_names", None)
    if names is not None and column not in names:
        raise ValueError(
            f"user_column={column!r} is not a column of the training set (columns: {names}). Add "
            "each example's user id, or set privacy_unit='example'."
        )
    if hasattr(dataset, "with_format"):  # a datasets.Dataset: the stored values in one read, whatever its format
        dataset = dataset.with_format(None)
    try:
        values = list(dataset[column][:]) if names is not None else [dataset[i][column] for i in range(len(dataset))]
    except (KeyError, TypeError) as error:
        raise ValueError(f"The training examples have no {column!r} entry (user_column): {error}.") from None
    return plain_user_ids(values, column)


def plain_user_ids(values: Sequence[Any], column: str) -> list[int | str]:
    """The ids as plain Python integers or strings, so one user is one value whatever the dataset's format: a 0-d
    tensor (`with_format("torch")`) hashes by identity and would make every row a user of its own. Tensors and numpy
    scalars read as the number they hold, whole floats as integers (a column with a gap is stored as floats).
    Refused, rows named: a missing id (None, NaN), a float that is not whole, anything but one integer or string,
    and a column mixing integers and strings ("1" and 1 would be two users)."""
    plain: list[int | str] = []
    refused: dict[str, list[int]] = {}
    for row, value in enumerate(values):
        value, problem = _plain_user_id(value)
        if problem:
            refused.setdefault(problem, []).append(row)
        plain.append(value)
    if refused:
        problem, rows = next(iter(refused.items()))
        raise ValueError(
            f"{len(rows)} training examples have {problem} in column {column!r} ({_rows(rows)}): every "
            "example must belong to one user, named by an integer or a string, or the user-level "
            "guarantee would not cover it. Drop them or give each its user."
        )
    kinds: dict[type, list[int]] = {str: [], int: []}
    for row, value in enumerate(plain):
        kinds[type(value)].append(row)
    if kinds[str] and kinds[int]:
        raise ValueError(
            f"Column {column!r} (user_column) mixes string ids ({_rows(kinds[str])}) and integer ids "
            f"({_rows(kinds[int])}): '1' and 1 would count as two users. Give every id one type, e.g. "
            f"dataset.cast_column({column!r}, Value('string'))."
        )
    return plain


def _plain_user_id(value: Any) -> tuple[Any, str | None]:
    """(the id as a plain value, None), or (the value, why it is no user id)."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        if getattr(value, "ndim", 0) != 0:
            return value, "an array, not one id,"
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return value, "no user"
    if isinstance(value, bool):
        return value, "a boolean, not an id,"
    if isinstance(value, float):
        return (int(value), None) if value.is_integer() else (value, "a float id that is not a whole number")
    if isinstance(value, int | str):
        return value, None
    return value, f"a {type(value).__name__}, not an integer or string id,"


def _rows(rows: Sequence[int], shown: int = 5) -> str:
    """Row numbers for a message: the first few, then how many more."""
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:shown]))}{more}"


@dataclass(frozen=True)
class UserIndex:
    """The users of a training set: `user_of[i]` is example i's user number (0 … users − 1, in first-seen order)."""

    column: str
    user_of: np.ndarray

    @classmethod
    def of(cls, dataset: Any, column: str) -> UserIndex:
        """Read `column` of `dataset` (`user_ids`) and number its users by value."""
        numbers: dict[int | str, int] = {}
        values = user_ids(dataset, column)
        user_of = np.fromiter(
            (numbers.setdefault(value, len(numbers)) for value in values), dtype=np.int64, count=len(values)
        )
        return cls(column, user_of)

    @property
    def users(self) -> int:
        return int(self.user_of.max()) + 1 if self.user_of.size else 0

    @property
    def examples(self) -> int:
        return int(self.user_of.size)

    def examples_per_user(self) -> np.ndarray:
        return np.bincount(self.user_of, minlength=self.users)

    def grouped(self) -> tuple[np.ndarray, np.ndarray]:
        """(order, starts): the example indices grouped by user (stable), and where each user's run starts (with
        the end appended), so user u's examples are order[starts[u]:starts[u + 1]]."""
        order = np.argsort(self.user_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.examples_per_user())])
        return order, starts


# ---------------------------------------------------------------------- ELS: each user capped once
def capped_size(index: UserIndex, k: int) -> int:
    """Examples left once every user keeps at most k: Σ_u min(n_u, k), whichever are kept."""
    return int(np.minimum(index.examples_per_user(), k).sum())


def cap_examples(index: UserIndex, k: int, random: SecretRandom) -> np.ndarray:
    """The sorted indices of the examples kept when every user keeps at most `k`, those with the smallest of one
    secret uniform per example (so which ones is independent of the data and of every other user)."""
    ranks = random.uniform(index.examples).numpy()
    order = np.lexsort((ranks, index.user_of))  # by user, then by the secret rank
    starts = np.concatenate([[0], np.cumsum(index.examples_per_user())])
    position = np.arange(index.examples) - starts[index.user_of[order]]
    return np.sort(order[position < k])


def stages_for(stages: Sequence[Any], config: Any) -> list[Any]:
    """The method's stages as the unit needs them accounted: under ELS every release samples examples of users who
    have at most k, so each stage carries k (a mixture of Gaussians per step); otherwise as they are."""
    if config.privacy_unit != "user" or config.user_sampling != "example":
        return list(stages)
    return [replace(stage, examples_per_user=config.max_examples_per_user) for stage in stages]


# ---------------------------------------------------------------------- what the plan says at user level
def sampled_unit(config: Any, unit: str) -> str:
    """What N, q and the logical batch count: examples under ELS (it samples the examples users keep), else `unit`."""
    return "example" if config.privacy_unit == "user" and config.user_sampling == "example" else unit


def user_level_plan(config: Any, index: UserIndex, steps_per_epoch: int) -> str:
    """What a user-level run does with the data, said once after the plan: which examples train, what
    num_train_epochs and the logged loss count (each differs from an example-level run's)."""
    if config.user_sampling == "user":
        k = config.examples_per_user
        takes = (
            "one of their examples (examples_per_user=1), drawn at random"
            if k == 1
            else f"the sum of up to examples_per_user={k} of their examples, drawn at random and clipped as one"
        )
        return (
            f"User-level sampling (ULS): each step, every sampled user contributes {takes}. num_train_epochs "
            f"counts passes over the {index.users} users ({steps_per_epoch} steps an epoch, each user sampled "
            f"about once), not over the {index.examples} examples. The logged loss is a mean per example."
        )
    k = config.max_examples_per_user
    return (
        f"Example-level sampling (ELS): each user keeps at most max_examples_per_user={k} of their examples, drawn "
        f"once at random: {capped_size(index, k)} of the {index.examples} training examples are kept, N and the "
        "batch count those, and ε is accounted for a user with that many examples in the data. num_train_epochs "
        "counts passes over the kept examples."
    )


# ---------------------------------------------------------------------- ULS: Poisson over users
class UserPoissonSampler(Sampler[list[int]]):
    """Yields Poisson(q) logical batches of *users*, each user as up to `examples_per_user` of their examples.

    Every step each user of this rank's shard (users rank, rank + W, …) is kept independently with probability q
    (float64 uniforms from the secret stream, drawn over all users and restricted to the shard, so the union over
    ranks is Poisson whatever the ranks' streams); a kept user's examples are ranked by a second secret uniform each
    and the first `examples_per_user` kept. The logical batch is yielded as `num_chunks` example lists (Trainer's
    accumulation steps), split between users, never inside one: a user's examples stay consecutive in one chunk on
    one process, so the engine can sum them into one term and clip it.
    """

    def __init__(
        self,
        index: UserIndex,
        sample_rate: float,
        steps_per_epoch: int,
        examples_per_user: int,
        num_chunks: int = 1,
        rank: int = 0,
        world_size: int = 1,
        random: SecretRandom | None = None,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        self.index, self.sample_rate = index, float(sample_rate)
        self.steps_per_epoch, self.examples_per_user = steps_per_epoch, examples_per_user
        self.num_chunks, self.rank, self.world_size = num_chunks, rank, world_size
        self.random = random if random is not None else SecretRandom()
        self._order, self._starts = index.grouped()
        self._shard = np.arange(rank, index.users, world_size)

    def _draw(self) -> list[np.ndarray]:
        """This rank's sampled users, each as the example indices it contributes this step."""
        users = self.index.users
        keep = self.random.uniform(users).numpy()[self.rank :: self.world_size] < self.sample_rate
        ranks = self.random.uniform(self.index.examples).numpy()  # one per example, in grouped order
        chosen = []
        for user in self._shard[keep]:
            start, stop = self._starts[user], self._starts[user + 1]
            mine = self._order[start:stop]
            if stop - start > self.examples_per_user:
                mine = mine[np.argsort(ranks[start:stop], kind="stable")[: self.examples_per_user]]
            chosen.append(np.sort(mine))
        return chosen

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            users = self._draw()
            bounds = np.linspace(0, len(users), self.num_chunks + 1).round().astype(int)
            for a, b in zip(bounds[:-1], bounds[1:]):
                yield [int(i) for user in users[a:b] for i in user]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_chunks


# ---------------------------------------------------------------------- carrying each example's user to the trainer
class UnitTagged:
    """The training set with each example tagged by its unit (its user), for `UnitCollator` to group."""

    def __init__(self, dataset: Any, unit_of: Sequence[int] | np.ndarray) -> None:
        self.dataset, self.unit_of = dataset, unit_of

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.dataset[i], UNIT_KEY: int(self.unit_of[i])}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """What a DataLoader fetches a batch with (a datasets.Dataset's own would drop the tags)."""
        fetch = getattr(self.dataset, "__getitems__", None)
        rows = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
        return [{**row, UNIT_KEY: int(self.unit_of[i])} for row, i in zip(rows, indices)]

    def __getattr__(self, name: str) -> Any:  # column_names, features, …: the dataset's own
        return getattr(self.dataset, name)


class UnitCollator:
    """Collates tagged examples with `collate_fn` (tags removed) and adds `unit_sizes`: how many consecutive examples
    each unit of the batch has (the sampler keeps a unit's examples consecutive)."""

    def __init__(self, collate_fn: Callable[[list], Mapping[str, Any]]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        units = [feature[UNIT_KEY] for feature in features]
        batch = dict(self.collate_fn([{k: v for k, v in f.items() if k != UNIT_KEY} for f in features]))
        sizes = run_lengths(units)
        if len(set(units)) != len(sizes):
            raise ValueError(
                "A unit's examples are not consecutive in the collated batch: the user-level sampler "
                "keeps them together, so this batch did not come from it."
            )
        batch[UNIT_SIZES_KEY] = torch.tensor(sizes, dtype=torch.long)
        return batch


def run_lengths(units: Sequence[int]) -> list[int]:
    """How many consecutive entries of `units` name the same unit, run by run ([7, 7, 3, 7] → [2, 1, 1])."""
    sizes: list[int] = []
    for i, unit in enumerate(units):
        if i and unit == units[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes
