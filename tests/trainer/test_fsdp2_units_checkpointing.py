"""Sharded (FSDP2) activation checkpointing, user-level units and evaluation during training through `PrivateTrainer`
(issue 49): two gloo processes against one unsharded process with the same arguments and test seed, as
tests/trainer/test_fsdp2_trainer.py runs them (the same worker, tests/support/fsdp2_trainer_worker.py, with its
`--checkpointing`, `--users` and `--evaluate` options).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.support import fsdp2_trainer_worker as worker
from tests.trainer.test_fsdp2_trainer import _relative, _result, _run_all

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# gradient_checkpointing=True (transformers' non-reentrant default, and reentrant), and FSDP's own
CHECKPOINTING = ["args", "reentrant", "fsdp"]


def _ledger(run: dict) -> dict:
    return json.loads((run["model_dir"] / "privacy_ledger.json").read_text())


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> dict:
    """The 1-process `noisy` run, without checkpointing."""
    root = tmp_path_factory.mktemp("fsdp2_plain")
    _run_all(root, {"world1": (1, root / "world1", ["--case", "noisy"])})
    return _result(root / "world1")


@pytest.fixture(scope="module", params=CHECKPOINTING)
def checkpointed(request, tmp_path_factory) -> dict:
    """The 2-process sharded `noisy` run with activation checkpointing asked for as `request.param` names."""
    root = tmp_path_factory.mktemp(f"fsdp2_checkpointing_{request.param}")
    _run_all(root, {"world2": (2, root / "world2", ["--case", "noisy", "--checkpointing", request.param])})
    return _result(root / "world2")


def test_a_checkpointed_sharded_run_releases_the_one_process_update(checkpointed, unsharded):
    """The recompute in backward (FSDP2 unsharding the layer again for it) records each example's terms as the
    forward did: the released weights equal one unsharded, uncheckpointed process's. Checkpointing was on: each
    backward began the first decoder layer's forward once more (at least once a step), which it never does without."""
    assert checkpointed["world_size"] == 2 and all(checkpointed["sharded"].values())
    recomputes = checkpointed["forwards"]["layer"] - checkpointed["forwards"]["model"]
    assert recomputes >= checkpointed["global_step"] == worker.STEPS["noisy"]
    assert unsharded["forwards"]["layer"] == unsharded["forwards"]["model"]
    before = dict(worker.tiny.llama().double().state_dict())
    assert _relative(unsharded["after"], before) > 1e-3
    assert _relative(checkpointed["after"], unsharded["after"]) <= 1e-5
    assert checkpointed["report"]["steps"] == unsharded["report"]["steps"] == worker.STEPS["noisy"]
    assert _ledger(checkpointed) == _ledger(unsharded)


def test_a_checkpointed_sharded_model_saves_under_its_own_names(checkpointed, unsharded):
    """FSDP's checkpointing wraps each layer (`_checkpoint_wrapped_module`): the saved weights keep their names."""
    saved = load_file(checkpointed["model_dir"] / "model.safetensors")
    assert set(saved) == set(load_file(unsharded["model_dir"] / "model.safetensors"))
    assert set(checkpointed["after"]) == set(unsharded["after"])


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> dict[int, dict]:
    """The `noisy` run at user level, sharded over 2 processes and in 1."""
    root = tmp_path_factory.mktemp("fsdp2_users")
    for n in (2, 1):  # one after the other: side by side they starve each other on a loaded 2-core machine
        _run_all(root, {f"world{n}": (n, root / f"world{n}", ["--case", "noisy", "--users"])})
    return {n: _result(root / f"world{n}") for n in (2, 1)}


def test_a_sharded_user_level_run_releases_the_one_process_update(users):
    """Each user's examples are summed into one term and clipped together on the process that drew the user; the
    filler chunks that even out the processes' chunk counts are plain rows whose loss counts zero."""
    sharded, single = users[2], users[1]
    assert sharded["world_size"] == 2 and all(sharded["sharded"].values())
    before = dict(worker.tiny.llama().double().state_dict())
    assert _relative(single["after"], before) > 1e-3
    assert _relative(sharded["after"], single["after"]) <= 1e-5


def test_a_sharded_user_level_run_accounts_for_users(users):
    """N counts users, q is the global rate over them, and the ledger and card are the one process's."""
    sharded, single = users[2]["report"], users[1]["report"]
    for report in (sharded, single):
        assert report["unit"] == "user" and report["user_column"] == "user_id"
        assert report["examples_per_user"] == worker.EXAMPLES_PER_USER
        assert report["dataset_size"] == worker.USERS < worker.DATASET_SIZE
        assert report["sample_rate"] == worker.LOGICAL_BATCH / worker.USERS
        assert report["steps"] == worker.STEPS["noisy"]
    figure = [r["not_a_guarantee"]["accounting_with_a_secret_seed"]["value"] for r in (sharded, single)]
    assert figure[0] == pytest.approx(figure[1], rel=1e-12) and figure[0] > 0
    assert _ledger(users[2]) == _ledger(users[1])
    assert "FSDP2" in users[2]["card"] and "user" in users[2]["card"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> dict[int, dict]:
    """The `noisy` run evaluated after every step, 1 process and 2 sharded ones (launched one after the other)."""
    root = tmp_path_factory.mktemp("fsdp2_evaluate")
    for n in (1, 2):
        _run_all(root, {f"world{n}": (n, root / f"world{n}", ["--case", "noisy", "--evaluate"])})
    return {n: _result(root / f"world{n}") for n in (1, 2)}


def test_a_sharded_run_evaluates_during_training_as_one_process_does(evaluated):
    one, sharded = evaluated[1], evaluated[2]
    assert len(sharded["eval_losses"]) == len(one["eval_losses"]) == worker.STEPS["noisy"]
    assert sharded["eval_losses"] == pytest.approx(one["eval_losses"], rel=1e-6)
    assert len(set(one["eval_losses"])) == worker.STEPS["noisy"], "each evaluation reads the weights of its step"
    assert _relative(sharded["after"], one["after"]) < 1e-5  # evaluating changes nothing that is released
