"""User-level DP (`DPConfig(privacy_unit="user", user_column=...)`): the config's rules, the index of users, the ULS
sampler, and through the public API that one user with many examples moves a released update by at most C.

The sensitivity tests run one SGD step at q = 1 under a test seed, so the noise replays and cancels between a run
with and a run without the added user; the released sum is (W₀ − W₁)·B/lr. A mutation test beside them clips the
user's examples apart (each example its own unit): the user then moves the sum by far more than C.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from functools import partial

import numpy as np
import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard
from transformers import DataCollatorWithPadding

import hf_private.data.chunks
import hf_private.data.units
import hf_private.data.users
import hf_private.run.privacy_run
import hf_private.trainer.mixin
from hf_private import DPConfig, FrostConfig
from hf_private.data.user_cap import UserExamples
from hf_private.data.users import UserIndex, UserPoissonSampler
from hf_private.privacy.rng import SecretRandom
from tests.support import tiny
from tests.support.helpers import TRL_TEST_ARGS, KillAtStep, make_trainer

pytestmark = pytest.mark.usefixtures("single_thread")

SEED = 20261126


def with_users(dataset: Dataset, users: list) -> Dataset:
    return dataset.add_column("user_id", users)


# ---------------------------------------------------------------------- the config's rules
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"user_column": "user_id"}, "user_column='user_id' is set but privacy_unit='example'"),
        ({"privacy_unit": "person"}, "privacy_unit must be 'example' or 'user'"),
        ({"privacy_unit": "user"}, "privacy_unit='user' needs user_column"),
        ({"privacy_unit": "user", "user_column": "u", "user_sampling": "batch"}, "user_sampling must be 'user'"),
        ({"privacy_unit": "user", "user_column": "u", "examples_per_user": 0}, "examples_per_user must be an integer"),
        ({"privacy_unit": "user", "user_column": "u", "max_examples_per_user": 4}, "max_examples_per_user is ELS's"),
        ({"privacy_unit": "user", "user_column": "u", "user_sampling": "example"}, "needs max_examples_per_user"),
        (
            {
                "privacy_unit": "user",
                "user_column": "u",
                "user_sampling": "example",
                "max_examples_per_user": 2,
                "examples_per_user": 3,
            },
            "examples_per_user is ULS's",
        ),
    ],
)
def test_the_unit_fields_are_checked_when_the_config_is_built(fields, message):
    with pytest.raises(ValueError, match=message):
        DPConfig(noise_multiplier=1.0, **fields)


# ---------------------------------------------------------------------- the users of a training set
def test_the_index_numbers_users_in_first_seen_order_and_refuses_examples_without_one():
    index = UserIndex.of(Dataset.from_dict({"user_id": ["b", "a", "b", "c", "a", "b"]}), "user_id")
    assert index.users == 3 and index.examples == 6 and index.user_of.tolist() == [0, 1, 0, 2, 1, 0]
    order, starts = index.grouped()
    assert [order[starts[u] : starts[u + 1]].tolist() for u in range(3)] == [[0, 2, 5], [1, 4], [3]]
    with pytest.raises(ValueError, match="2 training examples have no user in column 'user_id'"):
        UserIndex.of(Dataset.from_dict({"user_id": ["a", None, "b", None]}), "user_id")
    with pytest.raises(ValueError, match="user_column='author' is not a column"):
        UserIndex.of(Dataset.from_dict({"user_id": ["a"]}), "author")


@pytest.mark.parametrize("data_format", [None, "torch", "numpy"])
def test_users_are_compared_by_value_whatever_the_datasets_format(data_format):
    dataset = Dataset.from_dict({"user_id": [7, 3, 7, 3, 9]}).with_format(data_format)
    assert UserIndex.of(dataset, "user_id").user_of.tolist() == [0, 1, 0, 1, 2]
    # a dataset of rows (no column access), its ids as tensors, numpy scalars and whole floats: one user
    rows = [{"user_id": value} for value in (torch.tensor(7), np.int64(7), 7.0, np.float32(7.0), 7)]
    assert UserIndex.of(rows, "user_id").user_of.tolist() == [0] * 5


NAN = float("nan")


@pytest.mark.parametrize(
    "ids, message",
    [
        (["1", 1, "2", 2], r"mixes string ids \(rows 0, 2\) and integer ids \(rows 1, 3\)"),
        ([1.0, NAN, 2.0, NAN], r"2 training examples have no user in column 'user_id' \(rows 1, 3\)"),
        ([1.0, 1.5, 2.0], r"a float id that is not a whole number in column 'user_id' \(row 1\)"),
        ([1, None, 2], r"no user in column 'user_id' \(row 1\)"),
        ([True, False], r"a boolean, not an id, in column 'user_id' \(rows 0, 1\)"),
        ([[1], [2]], r"a list, not an integer or string id, in column 'user_id' \(rows 0, 1\)"),
    ],
)
@pytest.mark.parametrize("data_format", [None, "torch"])
def test_ids_that_are_not_one_plain_value_are_refused_with_their_rows(ids, message, data_format):
    rows = [{"user_id": torch.tensor(i) if data_format and isinstance(i, float) else i} for i in ids]
    with pytest.raises(ValueError, match=message):
        UserIndex.of(rows, "user_id")
    if all(isinstance(i, float) for i in ids):  # a float column as the datasets library stores it
        with pytest.raises(ValueError, match=message):
            UserIndex.of(Dataset.from_dict({"user_id": ids}).with_format(data_format), "user_id")


# ---------------------------------------------------------------------- ULS: Poisson over users
def _heavy_tailed_users(users: int, seed: int = 0) -> UserIndex:
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(1.8, users), 40)
    return UserIndex("user_id", rng.permutation(np.repeat(np.arange(users), counts)))


def test_uls_samples_users_at_rate_q_with_at_most_k_of_their_own_examples_never_split():
    index = _heavy_tailed_users(400)
    sampler = UserPoissonSampler(
        index,
        sample_rate=0.05,
        steps_per_epoch=200,
        examples_per_user=3,
        num_chunks=3,
        random=SecretRandom(test_seed=SEED),
    )
    chunks = list(sampler)
    assert len(chunks) == len(sampler) == 600
    sampled_users = []
    for step in range(200):
        users_in_step = []
        for chunk in chunks[3 * step : 3 * step + 3]:
            owners = index.user_of[chunk]
            runs = [owners[0]] + [u for prev, u in zip(owners, owners[1:]) if u != prev] if len(chunk) else []
            assert len(runs) == len(set(runs))  # each user's examples consecutive, once
            for user in runs:
                assert 1 <= (owners == user).sum() <= 3
            users_in_step += runs
        assert len(users_in_step) == len(set(users_in_step))  # a user in one chunk only
        sampled_users.append(len(users_in_step))
    # Poisson(q) over users: mean q·U = 20, sd √(U q (1 − q)) ≈ 4.4 per step, ≈ 0.31 for the mean of 200 steps
    assert abs(np.mean(sampled_users) - 20) < 5 * 0.31


def test_two_ranks_draw_the_users_one_process_draws_between_them():
    index = _heavy_tailed_users(100, seed=1)

    def draw(rank: int, world: int) -> list[list[int]]:
        sampler = UserPoissonSampler(
            index, 0.3, 5, examples_per_user=2, rank=rank, world_size=world, random=SecretRandom(test_seed=SEED)
        )
        return [sorted(chunk) for chunk in sampler]

    alone, first, second = draw(0, 1), draw(0, 2), draw(1, 2)
    for step in range(5):
        assert sorted(first[step] + second[step]) == alone[step]
        assert not set(index.user_of[first[step]]) & set(index.user_of[second[step]])


# ---------------------------------------------------------------------- through the trainer
def _user_rows(n_users: int, per_user: int, offset: int = 0) -> tuple[Dataset, list[int]]:
    data = tiny.sentiment_dataset(n_users * per_user, seed=offset)
    return data, [offset * 1000 + u for u in range(n_users) for _ in range(per_user)]


def user_trainer(tmp_path, dataset: Dataset, users: list, dp: DPConfig | None = None, **args):
    dp = dp or DPConfig(
        noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user", user_column="user_id", examples_per_user=4
    )
    return make_trainer(tmp_path, dataset=with_users(dataset, users), dp=dp, **args)


def test_trains_at_user_level_and_the_card_names_the_user_the_column_and_k(tmp_path, caplog):
    data, users = _user_rows(24, 3)
    with caplog.at_level("INFO", logger="transformers"):
        trainer = user_trainer(tmp_path, data, users, per_device_train_batch_size=4, num_train_epochs=1)
    assert trainer.dataset_size == 24 and trainer.sample_rate == pytest.approx(4 / 24)
    assert (
        "Private training plan (dp-sgd): N=24 users, sampling rate q=0.16667 (expected logical batch 4 users)"
        in caplog.text
        and "expected batch of 4 users" in caplog.text
    )
    trainer.train()
    report = trainer.privacy_report()
    assert report["unit"] == "user" and report["user_column"] == "user_id" and report["examples_per_user"] == 4
    assert report["dataset_size"] == 24 and report["steps"] == report["planned_steps"] == 6
    trainer.save_model(str(tmp_path / "out"))
    card = ModelCard.load(tmp_path / "out" / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert privacy["unit"] == "user" and privacy["user_column"] == "user_id" and privacy["examples_per_user"] == 4
    text = " ".join(card.text.split())
    assert "**one user**" in text and "24 users" in text and "at most 4 of their examples" in text
    assert "group privacy" not in text
    # ε recomputes from the card alone with an independent accountant (dp_accounting's PLD, not our PRV)
    assert independent_epsilon(privacy) == pytest.approx(privacy["epsilon"], rel=0.03)


def _plan(caplog, build) -> str:
    """The plan line `build()` logs, at the level a user's script shows (transformers' default, WARNING)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        build()
    plans = [r.getMessage() for r in caplog.records if "Private training plan" in r.getMessage()]
    assert len(plans) == 1
    return plans[0]


@pytest.mark.parametrize(
    "k, takes",
    [
        (1, "every sampled user contributes one of their examples (examples_per_user=1), drawn at random"),
        (4, "every sampled user contributes the sum of up to examples_per_user=4 of their examples"),
    ],
)
def test_the_uls_plan_says_which_examples_train_and_what_an_epoch_counts(tmp_path, caplog, k, takes):
    """Issue 45: ULS with k = 1 used one example per sampled user per step, and num_train_epochs counted users,
    silently."""
    data, users = _user_rows(24, 3)
    dp = DPConfig(
        noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user", user_column="user_id", examples_per_user=k
    )
    plan = _plan(caplog, lambda: user_trainer(tmp_path, data, users, dp=dp, per_device_train_batch_size=4))
    for said in (
        "N=24 users",
        "(expected logical batch 4 users)",
        takes,
        "num_train_epochs counts passes over the 24 users (6 steps an epoch, each user sampled about once), "
        "not over the 72 examples",
        "The logged loss is a mean per example.",
    ):
        assert said in plan


def test_the_els_plan_counts_the_kept_examples_as_examples_and_says_how_many_were_kept(tmp_path, caplog):
    """Issue 45: the ELS plan said "N=1301 users" for 1,301 kept examples of 3,000, and never said some were dropped."""
    data = tiny.sentiment_dataset(60)
    users = [i % 12 for i in range(60)]  # 12 users of 5 examples: 24 kept
    plan = _plan(caplog, lambda: user_trainer(tmp_path, data, users, dp=els_config(), per_device_train_batch_size=6))
    for said in (
        "N=24 examples",
        "(expected logical batch 6 examples)",
        "max_examples_per_user=2",
        "24 of the 60 training examples are kept",
        "passes over the kept examples",
    ):
        assert said in plan
    assert "users" not in plan.split("Example-level sampling")[0]


def test_the_uls_loss_is_logged_per_example_not_per_user(tmp_path):
    """Issue 45: at k = 4 the logged loss was a user's sum (3 examples each here: about 3x the per-example loss).
    Nothing trains (learning rate 0, no dropout), so every step's loss is of the initial model: logged over 40 steps,
    its mean is the per-example mean of the training set's losses to a Poisson batch's noise (std about 8% here)."""
    data, users = _user_rows(24, 3)
    model = tiny.bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model.eval()
    batch = DataCollatorWithPadding(tiny.tokenizer())(data.to_list())
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    per_example = float(torch.nn.functional.cross_entropy(logits, batch["labels"]))
    trainer = user_trainer(
        tmp_path, data, users, model=model, per_device_train_batch_size=4, max_steps=40, learning_rate=0.0
    )
    trainer.train()
    logged = float(np.mean([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]))
    assert logged == pytest.approx(per_example, rel=0.3)


def independent_epsilon(privacy: dict) -> float:
    """ε of the card's mechanisms by dp_accounting's PLD accountant at δ − the sampler's tail: Poisson-subsampled
    Gaussians, or under ELS the mixture of Gaussians of a user's J ~ Binomial(k, q) sampled examples."""
    import math

    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for m in privacy["mechanisms"]:
        k, q, sigma = m.get("examples_per_user"), m["sample_rate"], m["noise_multiplier"]
        if k is None:
            event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        else:
            probs = [math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k + 1)]
            event = dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)), probs)
        accountant.compose(dp_event.SelfComposedDpEvent(event, m["steps"]))
    return accountant.get_epsilon(privacy["delta"] - privacy.get("sampler_tail_delta", 0.0))


def released_sum(
    tmp_path, dataset: Dataset, users: list, dp: DPConfig, units: int, data_format: str | None = None
) -> torch.Tensor:
    """Σ of the clipped per-unit gradients plus the replayed noise, read off one SGD step at q = 1 (`units`: the
    expected batch, every user under ULS, every kept example under ELS; `data_format`: the dataset's, e.g. "torch")."""
    model = tiny.bert()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    trainer = make_trainer(
        tmp_path,
        model=model,
        dataset=with_users(dataset, users).with_format(data_format),
        dp=dp,
        per_device_train_batch_size=units,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
    )
    assert trainer.sample_rate == 1.0
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return (before - after) * units


def uls_released_sum(
    tmp_path,
    dataset: Dataset,
    users: list,
    clip: float,
    k: int,
    data_format: str | None = None,
    units: int | None = None,
) -> torch.Tensor:
    dp = DPConfig(
        noise_multiplier=0.2,
        max_grad_norm=clip,
        noise_seed=SEED,
        privacy_unit="user",
        user_column="user_id",
        examples_per_user=k,
    )
    return released_sum(tmp_path, dataset, users, dp, units or len(set(users)), data_format)


MATES, MATE_USERS = _user_rows(6, 2)  # six users with two examples each
ADDED = tiny.sentiment_dataset(10, seed=9)  # one user with ten
ADDED_USERS = [777] * 10


def _with_added() -> tuple[Dataset, list]:
    from datasets import concatenate_datasets

    return concatenate_datasets([MATES, ADDED]), MATE_USERS + ADDED_USERS


def sensitivity(tmp_path, clip: float, k: int, data_format: str | None = None, rows_as_units: bool = False) -> float:
    """How far adding the user moves the release; `rows_as_units`: a batch of every row, so q = 1 for an index that
    counts rows as users."""
    data, users = _with_added()

    def release(name: str, dataset: Dataset, ids: list) -> torch.Tensor:
        return uls_released_sum(
            tmp_path / name, dataset, ids, clip, k, data_format, units=len(ids) if rows_as_units else None
        )

    return float((release("with", data, users) - release("without", MATES, MATE_USERS)).norm())


CLIP = 0.01  # below every example's gradient norm: every user is clipped


def test_adding_one_user_with_many_examples_moves_the_released_sum_by_at_most_C(tmp_path):
    for k in (1, 4, 10):
        assert sensitivity(tmp_path / str(k), CLIP, k) <= CLIP * (1 + 1e-4)


def apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: every example its own unit in chunks (training) and in one-off samples (a method's releases)."""
    slices = hf_private.data.chunks.unit_slices
    for module in (hf_private.data.chunks, hf_private.data.units):
        monkeypatch.setattr(module, "unit_slices", lambda sizes, per: slices([1] * int(sum(sizes)), per))


def test_the_sensitivity_test_fails_when_a_users_examples_are_clipped_apart(tmp_path, monkeypatch):
    """Each example its own unit (no per-user grouping): the user's k examples each move the sum by up to C."""
    apart(monkeypatch)
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    assert sensitivity(tmp_path, CLIP, 10) > 3 * CLIP


def torch_formatted_users(tmp_path, data: Dataset, users: list) -> int:
    """The users a user-level trainer counts in `data` with `users` as its user column, in the torch format."""
    dp = DPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", examples_per_user=1)
    trainer = make_trainer(
        tmp_path, dataset=with_users(data, users).with_format("torch"), dp=dp, per_device_train_batch_size=2
    )
    return trainer.dataset_size


def test_ids_read_as_tensors_count_users_and_one_user_moves_the_release_by_at_most_C(tmp_path):
    """with_format("torch") hands the ids over as 0-d tensors, which hash by identity: read by value, the trainer
    counts 7 users, not 22 rows, and the added user with ten examples moves the release by at most C."""
    data, users = _with_added()
    assert torch_formatted_users(tmp_path / "count", data, users) == len(set(users)) < len(users)
    for k in (1, 10):
        assert sensitivity(tmp_path / str(k), CLIP, k, data_format="torch") <= CLIP * (1 + 1e-4)


def test_the_tensor_id_test_fails_when_ids_are_compared_as_the_dataset_hands_them_over(tmp_path, monkeypatch):
    """Without `users.user_ids` (the column listed as the torch format gives it): every row is a user of its own, so
    N counts rows and the added user's ten examples each move the release by up to C."""
    monkeypatch.setattr(hf_private.data.users, "user_ids", lambda dataset, column: list(dataset[column]))
    data, users = _with_added()
    assert torch_formatted_users(tmp_path / "count", data, users) == len(users)
    assert sensitivity(tmp_path, CLIP, 1, data_format="torch", rows_as_units=True) > 3 * CLIP


HUGE = 50.0  # above every user's gradient norm here: nothing is clipped
OTHER_MATES, OTHER_MATE_USERS = _user_rows(5, 3, offset=3)


def test_a_users_contribution_does_not_depend_on_the_other_users(tmp_path):
    from datasets import concatenate_datasets

    contributions = []
    for name, mates, mate_users in (("a", MATES, MATE_USERS), ("b", OTHER_MATES, OTHER_MATE_USERS)):
        both = concatenate_datasets([mates, ADDED])
        contributions.append(
            uls_released_sum(tmp_path / f"{name}+", both, mate_users + ADDED_USERS, HUGE, 10)
            - uls_released_sum(tmp_path / name, mates, mate_users, HUGE, 10)
        )
    assert contributions[0].norm() > 0
    torch.testing.assert_close(contributions[0], contributions[1], rtol=0, atol=1e-3 * float(contributions[0].norm()))


# ---------------------------------------------------------------------- TRL's trainers at user level
def _trl_at_user_level(kind: str, tmp_path):
    """(privatized trainer at user level, expected users, TRL's trainer name): SFT on conversations of 7 users, DPO on
    preference pairs of 5 (a user's pairs are grouped as their rows are: n pairs are one unit of 2n rows)."""
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_private import privatize

    if kind == "sft":
        users = [u % 7 for u in range(24)]
        args = SFTConfig(
            str(tmp_path), **TRL_TEST_ARGS, per_device_train_batch_size=3, num_train_epochs=1, assistant_only_loss=True
        )
        build = partial(
            privatize(SFTTrainer), tiny.llama(), args, train_dataset=with_users(tiny.conversations(24), users)
        )
        k = 2
    else:
        users = [u % 5 for u in range(24)]
        args = DPOConfig(str(tmp_path), **TRL_TEST_ARGS, per_device_train_batch_size=2, num_train_epochs=1)
        build = partial(
            privatize(DPOTrainer),
            tiny.llama(),
            tiny.llama(),
            args,
            train_dataset=with_users(tiny.preference_pairs(24), users),
        )
        k = 3
    trainer = build(
        processing_class=tiny.chat_tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", examples_per_user=k),
    )
    return trainer, len(set(users)), f"trl.{kind.upper()}Trainer"


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_privatized_trl_trainers_train_at_user_level(kind, tmp_path):
    trainer, users, name = _trl_at_user_level(kind, tmp_path)
    assert trainer.dataset_size == users
    trainer.train()
    report = trainer.privacy_report()
    assert report["unit"] == "user" and report["trainer"] == name and report["steps"] > 0


# ---------------------------------------------------------------------- resume and the budget at user level


def test_kill_and_resume_continue_the_user_level_ledger_and_the_budget_holds(tmp_path):
    data, users = _user_rows(30, 2)
    dp = DPConfig(target_epsilon=2.0, privacy_unit="user", user_column="user_id", examples_per_user=2)
    settings = dict(dp=dp, max_steps=8, per_device_train_batch_size=6)
    full = user_trainer(tmp_path / "full", data, users, **settings)
    full.train()

    interrupted = user_trainer(tmp_path / "run", data, users, **settings, save_strategy="steps", save_steps=4)
    interrupted.add_callback(KillAtStep(at_step=6))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = user_trainer(tmp_path / "run", data, users, **settings, save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.ledger.total_steps == 8 and resumed.privacy_report()["unit"] == "user"
    assert resumed.ledger.epsilon() == pytest.approx(full.ledger.epsilon(), rel=1e-12)
    assert resumed.ledger.epsilon() <= 2.0

    # the budget is spent: asking for more steps trains nothing and spends nothing
    more = user_trainer(tmp_path / "run", data, users, dp=dp, max_steps=12, per_device_train_batch_size=6)
    more.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-8"))
    assert more.ledger.total_steps == 8 and more.ledger.epsilon() == pytest.approx(resumed.ledger.epsilon())


# ---------------------------------------------------------------------- ELS: each user capped, examples sampled
def test_the_cap_keeps_at_most_k_examples_of_each_user_drawn_secretly():
    from hf_private.data.users import cap_examples, capped_size

    index = _heavy_tailed_users(300, seed=2)
    kept = cap_examples(index, 3, SecretRandom(test_seed=SEED))
    counts = np.bincount(index.user_of[kept], minlength=index.users)
    assert (counts == np.minimum(index.examples_per_user(), 3)).all() and len(kept) == capped_size(index, 3)
    again = cap_examples(index, 3, SecretRandom(test_seed=SEED + 1))
    assert not np.array_equal(kept, again)  # which ones comes from the secret stream, not the data's order


def els_config(**fields) -> DPConfig:
    return DPConfig(
        **{
            "noise_multiplier": 1.0,
            "privacy_unit": "user",
            "user_column": "user_id",
            "user_sampling": "example",
            "max_examples_per_user": 2,
            **fields,
        }
    )


def test_els_trains_on_the_capped_examples_and_accounts_for_the_user(tmp_path):
    data = tiny.sentiment_dataset(60)
    users = [i % 12 for i in range(60)]  # 12 users of 5 examples: 24 kept
    trainer = user_trainer(tmp_path, data, users, dp=els_config(), per_device_train_batch_size=6, max_steps=4)
    assert trainer.dataset_size == 24 and trainer.sample_rate == pytest.approx(6 / 24)
    trainer.train()
    report = trainer.privacy_report()
    assert report["unit"] == "user" and report["user_sampling"] == "example" and report["max_examples_per_user"] == 2
    assert [m["examples_per_user"] for m in report["mechanisms"]] == [2]
    assert independent_epsilon(report) == pytest.approx(report["epsilon"], rel=0.03)
    record = user_trainer(
        tmp_path / "k1", data, users, dp=els_config(max_examples_per_user=1), per_device_train_batch_size=3, max_steps=4
    )
    record.train()
    # the same σ and q: a user with two examples in reach costs more than one with one
    assert report["epsilon"] > record.privacy_report()["epsilon"]


def els_released_sum(tmp_path, dataset: Dataset, users: list, clip: float, k: int) -> torch.Tensor:
    dp = els_config(noise_multiplier=1.0, max_grad_norm=clip, noise_seed=SEED, max_examples_per_user=k)
    kept = int(np.minimum(np.bincount(np.unique(users, return_inverse=True)[1]), k).sum())
    return released_sum(tmp_path, dataset, users, dp, kept)


def test_els_one_user_moves_the_release_by_at_most_k_C_and_the_test_fails_without_the_cap(tmp_path, monkeypatch):
    from datasets import concatenate_datasets

    both = concatenate_datasets([MATES, ADDED])

    def moved(name: str) -> float:
        return float(
            (
                els_released_sum(tmp_path / f"{name}+", both, MATE_USERS + ADDED_USERS, CLIP, 3)
                - els_released_sum(tmp_path / name, MATES, MATE_USERS, CLIP, 3)
            ).norm()
        )

    capped = moved("capped")
    assert CLIP < capped <= 3 * CLIP * (1 + 1e-4)  # the user's 3 kept examples, each clipped to C
    monkeypatch.setattr(hf_private.run.privacy_run, "cap_examples", lambda index, k, random: np.arange(index.examples))
    assert moved("uncapped") > 3 * CLIP * (1 + 1e-3)  # all ten examples of the user: beyond the accounted k·C


def test_an_els_resume_keeps_the_examples_each_user_kept(tmp_path):
    data = tiny.sentiment_dataset(60)
    users = [i % 12 for i in range(60)]
    settings = dict(
        dp=els_config(target_epsilon=4.0, noise_multiplier=None), max_steps=6, per_device_train_batch_size=6
    )
    interrupted = user_trainer(tmp_path, data, users, **settings, save_strategy="steps", save_steps=3)
    interrupted.add_callback(KillAtStep(at_step=4))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    kept = interrupted.privacy_run.kept_examples.copy()
    assert (tmp_path / "checkpoint-3" / "user_cap.json").is_file()
    resumed = user_trainer(tmp_path, data, users, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert np.array_equal(resumed.privacy_run.kept_examples, kept) and resumed.ledger.total_steps == 6
    assert resumed.ledger.epsilon() <= 4.0


# one user with 20 examples and 20 users with one each, capped at k = 1: the shape in which kept row numbers went wrong
OWNER_DATA = tiny.sentiment_dataset(40, seed=4)
OWNER_USERS = [0] * 20 + list(range(1, 21))
REVERSED = list(range(39, -1, -1))


def interrupted_els_run(tmp_path) -> dict:
    """An ELS run at k = 1 on OWNER_DATA killed after its checkpoint-1: the settings to resume it with."""
    settings = dict(
        dp=els_config(max_examples_per_user=1),
        max_steps=3,
        per_device_train_batch_size=3,
        save_strategy="steps",
        save_steps=1,
    )
    interrupted = user_trainer(tmp_path, OWNER_DATA, OWNER_USERS, **settings)
    interrupted.add_callback(KillAtStep(at_step=2))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    settings["kept"] = examples_of(interrupted)
    return settings


def examples_of(trainer) -> list[tuple]:
    """The (user, tokens) of the examples an ELS trainer kept, sorted: what they are, whatever their rows."""
    rows = trainer.train_dataset.with_format(None).select(trainer.privacy_run.kept_examples)
    return sorted(zip(rows["user_id"], map(tuple, rows["input_ids"])))


def resume_reordered(tmp_path, settings: dict, data: Dataset = OWNER_DATA):
    settings = {k: v for k, v in settings.items() if k != "kept"}
    resumed = user_trainer(tmp_path, data.select(REVERSED), [OWNER_USERS[i] for i in REVERSED], **settings)
    resumed.train(resume_from_checkpoint=True)
    return resumed


def kept_per_user(trainer) -> Counter:
    """How many examples each user id kept."""
    return Counter(user for user, _ in examples_of(trainer))


def test_an_els_resume_with_the_rows_reordered_keeps_the_same_examples_and_the_cap(tmp_path):
    import json

    settings = interrupted_els_run(tmp_path)
    resumed = resume_reordered(tmp_path, settings)
    assert examples_of(resumed) == settings["kept"] and max(kept_per_user(resumed).values()) == 1
    assert resumed.ledger.total_steps == 3 and resumed.privacy_report()["max_examples_per_user"] == 1
    record = json.loads((tmp_path / "checkpoint-1" / "user_cap.json").read_text())
    marks = [mark for kept in record["users"].values() for mark in kept]
    assert len(record["users"]) == 21 and len(marks) == 21  # every user, by a tag, and each kept example by a mark
    assert all(len(name) == 64 and int(name, 16) >= 0 for name in [*record["users"], *marks])  # hashes, no ids


def test_an_els_resume_on_changed_rows_is_refused_naming_the_users_and_rows(tmp_path):
    settings = interrupted_els_run(tmp_path)
    changed = OWNER_DATA.map(lambda row, i: {"label": 1 - row["label"]} if i == 30 else {}, with_indices=True)
    with pytest.raises(
        ValueError,
        match=r"not the one the checkpoint's ELS cap was drawn on. Users whose examples "
        r"differ from all of the checkpoint's: 1 of 21 \(first seen at rows 9; 1 rows "
        r"between them\). The checkpoint's users not found: 1\.",
    ):
        resume_reordered(tmp_path, settings, changed)


def test_the_reordered_resume_test_fails_when_the_cap_keeps_row_numbers(tmp_path, monkeypatch):
    """The cap stored as the rows it kept (as it was): the reversed training set gives user 0 nearly every kept row."""
    monkeypatch.setattr(UserExamples, "record", lambda self, kept: {"rows": [int(i) for i in kept]})
    monkeypatch.setattr(UserExamples, "kept_from", lambda self, record, k: np.asarray(record["rows"]))
    resumed = resume_reordered(tmp_path, interrupted_els_run(tmp_path))
    assert kept_per_user(resumed)[0] > 1  # user 0 (20 examples) under a cap of 1


def test_a_user_cap_naming_rows_is_refused(tmp_path):
    import json
    import types

    from hf_private.release.checkpoints import load_user_cap

    (tmp_path / "user_cap.json").write_text(
        json.dumps({"user_column": "user_id", "max_examples_per_user": 1, "kept": [0, 3]})
    )  # an earlier version's
    with pytest.raises(ValueError, match="names the kept examples by row number"):
        load_user_cap(str(tmp_path), types.SimpleNamespace(user_column="user_id", max_examples_per_user=1))


def test_dp_frost_under_els_accounts_its_selection_rounds_for_the_user_too(tmp_path):
    """DP-FROST's selection rounds sample examples on their own: under ELS they draw from the capped examples, and
    every release, selection and training alike, is a mixture-of-Gaussians event with k."""
    data = tiny.sentiment_dataset(60)
    users = [i % 12 for i in range(60)]
    dp = FrostConfig(
        noise_multiplier=1.0,
        privacy_unit="user",
        user_column="user_id",
        user_sampling="example",
        max_examples_per_user=2,
        unfreeze_ratio=0.3,
        selection_sample_rate=0.25,
    )
    trainer = user_trainer(tmp_path, data, users, dp=dp, per_device_train_batch_size=6, max_steps=3)
    trainer.train()
    report = trainer.privacy_report()
    assert len(report["mechanisms"]) >= 2 and all(m["examples_per_user"] == 2 for m in report["mechanisms"])
    assert independent_epsilon(report) == pytest.approx(report["epsilon"], rel=0.03)


# ---------------------------------------------------------------------- methods with releases of their own (ULS)
def frost_uls(clip: float, k: int, **fields) -> FrostConfig:
    return FrostConfig(
        **{
            "noise_multiplier": 1.0,
            "max_grad_norm": clip,
            "privacy_unit": "user",
            "user_column": "user_id",
            "examples_per_user": k,
            "unfreeze_ratio": 0.3,
            "selection_sample_rate": 0.25,
            **fields,
        }
    )


def test_dp_frost_under_uls_samples_users_in_its_selection_rounds(tmp_path, monkeypatch):
    """Every selection round is a Poisson sample of users at q_ps over users, each with up to k of their examples
    in one chunk; the selection and the training steps are accounted over users."""
    from hf_private.run.method_view import MethodView

    data, users = _user_rows(12, 5)
    index = UserIndex.of(with_users(data, users), "user_id")
    drawn: list[list[int]] = []
    sample = MethodView.poisson_sample

    def spy(self, stage):
        chunks = sample(self, stage)
        drawn.extend(chunk["unit_sizes"].tolist() for chunk in chunks)
        return chunks

    monkeypatch.setattr(MethodView, "poisson_sample", spy)
    trainer = user_trainer(
        tmp_path,
        data,
        users,
        dp=frost_uls(1.0, 3, selection_sample_rate=0.5),
        per_device_train_batch_size=4,
        max_steps=2,
    )
    assert trainer.dataset_size == index.users == 12
    trainer.train()
    assert drawn and all(1 <= n <= 3 for sizes in drawn for n in sizes)
    assert 0 < sum(len(sizes) for sizes in drawn) <= 12 * trainer.dp_config.selection_rounds
    assert all(len(sizes) <= 4 for sizes in drawn)  # per_device_train_batch_size users per chunk
    report = trainer.privacy_report()
    rates = {m["name"]: m["sample_rate"] for m in report["mechanisms"]}
    assert rates == {"dp-frost-selection": 0.5, "dp-frost": pytest.approx(4 / 12)}
    assert report["unit"] == "user" and report["dataset_size"] == 12
    assert independent_epsilon(report) == pytest.approx(report["epsilon"], rel=0.03)


def first_selection_release(
    tmp_path, dataset: Dataset, users: list, clip: float, k: int, monkeypatch
) -> tuple[torch.Tensor, float]:
    """The first noisy magnitudes DP-FROST releases (q_ps = 1, noise replayed under the test seed) and the
    sensitivity the reducer claimed for them."""
    from hf_private.run.method_view import MethodView

    releases: list[tuple[torch.Tensor, float]] = []
    release = MethodView.release

    def spy(self, stage, values, sensitivity):
        noisy = release(self, stage, values, sensitivity)
        releases.append((noisy.double(), sensitivity))
        return noisy

    with monkeypatch.context() as patch:
        patch.setattr(MethodView, "release", spy)
        trainer = make_trainer(
            tmp_path,
            model=tiny.bert(),
            dataset=with_users(dataset, users),
            dp=frost_uls(clip, k, selection_sample_rate=1.0, selection_rounds=1, noise_seed=SEED),
            per_device_train_batch_size=len(set(users)),
            max_steps=1,
        )
        trainer.train()
    return releases[0]


def selection_sensitivity(tmp_path, clip: float, k: int, monkeypatch) -> tuple[float, float]:
    """(how far adding the ten-example user moves the first selection release, the sensitivity claimed)."""
    data, users = _with_added()
    with_user, claimed = first_selection_release(tmp_path / "with", data, users, clip, k, monkeypatch)
    without, claimed_without = first_selection_release(tmp_path / "without", MATES, MATE_USERS, clip, k, monkeypatch)
    assert claimed == claimed_without
    return float((with_user - without).norm()), claimed


def test_adding_one_user_moves_a_dp_frost_selection_release_by_at_most_its_sensitivity(tmp_path, monkeypatch):
    moved, claimed = selection_sensitivity(tmp_path, CLIP, 10, monkeypatch)
    assert 0 < moved <= claimed * (1 + 1e-4)


def test_the_selection_sensitivity_test_fails_when_a_users_examples_are_measured_apart(tmp_path, monkeypatch):
    apart(monkeypatch)
    monkeypatch.setattr(hf_private.trainer.mixin, "probe_example_independence", lambda *args, **kwargs: None)
    moved, claimed = selection_sensitivity(tmp_path, CLIP, 10, monkeypatch)
    assert moved > 3 * claimed


@pytest.mark.parametrize("sampling", ["user", "example"])
def test_sound_dp_fp_trains_at_user_level_with_its_head_clipped_per_unit(tmp_path, sampling):
    """Sound DP-FP's guarantee is its head's DP-SGD, which clips a user's summed gradient (ULS) or is accounted
    for a user's k examples (ELS); its representation noise is not counted in ε at any unit."""
    from hf_private import DPFPConfig

    data, users = _user_rows(12, 4)
    unit = {"examples_per_user": 3} if sampling == "user" else {"max_examples_per_user": 2}
    dp = DPFPConfig(noise_multiplier=1.0, privacy_unit="user", user_column="user_id", user_sampling=sampling, **unit)
    trainer = user_trainer(tmp_path, data, users, dp=dp, per_device_train_batch_size=4, max_steps=3)
    trainer.train()
    report = trainer.privacy_report()
    assert report["unit"] == "user" and report["method"] == "dp-fp" and report["steps"] == 3
    assert math.isfinite(report["epsilon"])
    assert independent_epsilon(report) == pytest.approx(report["epsilon"], rel=0.03)
    trainer.save_model(str(tmp_path / "out"))
    text = " ".join(ModelCard.load(tmp_path / "out" / "README.md").text.split())
    assert "**one user**" in text
