"""`data.units`: the privacy unit chosen once from the method config (`units_for`), and each unit through the one
interface the trainer uses: the training view, its collator, the Poisson sampler and a one-off Poisson sample."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset

from hf_private import DPConfig
from hf_private.data.units import CappedUserUnits, ExampleUnits, UserUnits, units_for
from hf_private.data.users import UNIT_KEY, UNIT_SIZES_KEY, UserIndex
from hf_private.privacy.rng import SecretRandom

USERS = [7, 7, 7, 3, 5, 5, 9]  # example i's user: 7 has three examples, 5 two, 3 and 9 one each
LENGTHS = [3, 1, 4, 1, 5, 9, 2]


def args(**overrides) -> SimpleNamespace:
    """What a unit reads of TrainingArguments."""
    return SimpleNamespace(
        **{
            "process_index": 0,
            "world_size": 1,
            "per_device_train_batch_size": 2,
            "train_sampling_strategy": "random",
            "length_column_name": "length",
            **overrides,
        }
    )


def dataset() -> Dataset:
    return Dataset.from_dict({"input_ids": [list(range(1, n + 1)) for n in LENGTHS], "user_id": USERS})


def collate(features: list[dict]) -> dict:
    return {"input_ids": torch.tensor([f["input_ids"][0] for f in features])}


def random() -> SecretRandom:
    return SecretRandom(test_seed=0)


def user_config(sampling: str, **fields) -> DPConfig:
    return DPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", user_sampling=sampling, **fields)


def not_capped(users: UserIndex) -> np.ndarray:
    raise AssertionError("only ELS draws a cap")


# ---------------------------------------------------------------------- the choice, made once from the config
@pytest.mark.parametrize(
    "config, unit",
    [
        (DPConfig(noise_multiplier=1.0), ExampleUnits),
        (user_config("user", examples_per_user=2), UserUnits),
        (user_config("example", max_examples_per_user=2), CappedUserUnits),
    ],
)
def test_the_config_chooses_the_unit(config, unit):
    units = units_for(config, args(), dataset(), not_capped)
    assert type(units) is unit
    assert (units.users is None) == (unit is ExampleUnits)


def test_the_users_already_read_are_kept_else_read_from_the_training_set():
    read = UserIndex.of(dataset(), "user_id")
    assert units_for(user_config("user"), args(), dataset(), not_capped, users=read).users is read
    again = units_for(user_config("user"), args(), dataset(), not_capped).users
    assert again is not read and again.user_of.tolist() == read.user_of.tolist() == [0, 0, 0, 1, 2, 2, 3]


# ---------------------------------------------------------------------- examples
def test_example_units_sample_examples_and_slice_a_one_off_sample_by_examples():
    units = ExampleUnits(args())
    data = dataset()
    view, view_collate = units.training_view(data, collate)
    assert view is data and view_collate is collate
    assert list(units.poisson_sampler(view, 1.0, 2, 3, random())) == [[0, 1, 2], [3, 4], [5, 6]] * 2
    assert units.poisson_sample(view, 1.0, random()) == [[0, 1], [2, 3], [4, 5], [6]]
    assert units.unit_sizes([4, 0, 6]) == [1, 1, 1] and units.in_unit_order([4, 0, 6]) == [4, 0, 6]
    assert units.examples_per_batch(0.5, 3.0) == 3.0


def test_example_units_sort_chunks_by_length_when_asked():
    units = ExampleUnits(args(train_sampling_strategy="group_by_length"))
    data = dataset()
    lengths = units.chunk_lengths(data, None, data, collate)
    assert lengths.tolist() == LENGTHS
    batch = next(iter(units.poisson_sampler(data, 1.0, 1, 1, random(), lengths)))
    assert [LENGTHS[i] for i in batch] == sorted(LENGTHS)
    assert ExampleUnits(args()).chunk_lengths(data, None, data, collate) is None


def test_example_units_shard_the_sample_over_processes():
    data = dataset()
    shards = [
        ExampleUnits(args(process_index=rank, world_size=2)).poisson_sample(data, 1.0, random()) for rank in (0, 1)
    ]
    assert shards == [[[0, 2], [4, 6]], [[1, 3], [5]]]


def test_capped_user_units_sort_the_kept_examples_by_their_own_lengths():
    """Regression: the lengths were read from the whole training set (7 here) for a view of the kept rows (5), and
    ELS with group_by_length or a packing collator stopped with 'lengths has 7 entries for 5 examples'."""
    kept = np.array([0, 2, 3, 4, 6])
    units = CappedUserUnits(
        args(train_sampling_strategy="group_by_length"), UserIndex.of(dataset(), "user_id"), lambda users: kept
    )
    view, _ = units.training_view(dataset(), collate)
    lengths = units.chunk_lengths(dataset(), None, view, collate)
    assert lengths.tolist() == [LENGTHS[i] for i in kept]
    batch = next(iter(units.poisson_sampler(view, 1.0, 1, 1, random(), lengths)))
    assert sorted(batch) == list(range(len(kept))) and [lengths[i] for i in batch] == sorted(lengths.tolist())


# ---------------------------------------------------------------------- ULS: users
def uls(k: int = 2) -> UserUnits:
    return UserUnits(args(), UserIndex.of(dataset(), "user_id"), k)


def test_user_units_tag_examples_and_collate_the_examples_of_each_user():
    view, view_collate = uls().training_view(dataset(), collate)
    assert view[1][UNIT_KEY] == 0 and view[3][UNIT_KEY] == 1 and len(view) == len(USERS)
    batch = view_collate([view[i] for i in (0, 1, 4, 5, 3)])
    assert batch[UNIT_SIZES_KEY].tolist() == [2, 2, 1] and batch["input_ids"].tolist() == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_user_units_sample_users_each_with_at_most_k_of_their_examples(k):
    units = uls(k)
    view, _ = units.training_view(dataset(), collate)
    (batch,) = units.poisson_sampler(view, 1.0, 1, 1, random(), lengths=torch.tensor(LENGTHS))
    users = [USERS[i] for i in batch]
    assert sorted(set(users)) == [3, 5, 7, 9]  # q = 1: every user
    assert all(users.count(user) == min(USERS.count(user), k) for user in set(users))
    assert units.unit_sizes(batch) == [min(USERS.count(user), k) for user in dict.fromkeys(users)]


def test_a_one_off_user_sample_keeps_each_users_examples_in_one_chunk():
    units = uls(3)
    chunks = units.poisson_sample(units.training_view(dataset(), collate)[0], 1.0, random())
    assert [[USERS[i] for i in chunk] for chunk in chunks] == [[7, 7, 7, 3], [5, 5, 9]]  # 2 users a chunk


def test_user_units_order_the_probe_by_user_and_count_the_examples_a_batch_brings():
    units = uls(2)
    assert [USERS[i] for i in units.in_unit_order([6, 0, 4, 1, 3])] == [7, 7, 3, 5, 9]
    assert units.examples_per_batch(0.5, 99.0) == pytest.approx(0.5 * (2 + 1 + 2 + 1))
    assert units.chunk_lengths(dataset(), None, dataset(), collate) is None  # chunks hold whole users


# ---------------------------------------------------------------------- ELS: capped users
def test_capped_user_units_sample_examples_of_the_kept_rows_only():
    index = UserIndex.of(dataset(), "user_id")
    asked = []
    units = CappedUserUnits(args(), index, lambda users: asked.append(users) or np.array([0, 2, 3, 4, 6]))
    view, view_collate = units.training_view(dataset(), collate)
    assert asked == [index] and view_collate is collate
    assert view["user_id"] == [7, 7, 3, 5, 9]
    assert units.poisson_sample(view, 1.0, random()) == [[0, 1], [2, 3], [4]]  # indices into the view
    as_list, _ = units.training_view(list(dataset()), collate)  # not a datasets.Dataset: a Subset of the kept rows
    assert [row["user_id"] for row in as_list] == [7, 7, 3, 5, 9]
