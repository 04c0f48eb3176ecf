"""Sharded (FSDP2) private training through `PrivateTrainer` (issue 49): two gloo processes launched as a user
without a GPU would (`torchrun --nproc-per-node 2`, `TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2},
use_cpu=True)`) against one unsharded process with the same arguments and test seed (tests/support/
fsdp2_trainer_worker.py). Both runs are subprocesses: the worker patches the sampler to record its draws.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from hf_private.trainer.sharded import check_resumable
from tests.support import fsdp2_trainer_worker as worker
from tests.support.launch import torchrun

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

WORKER = Path(worker.__file__)
TIMEOUT_S = 300  # the runs of one fixture together; they take well under a minute on an idle machine


def _command(processes: int, out: Path, *worker_args: str) -> list[str]:
    worker_args = ("--out", str(out), *worker_args)
    if processes == 1:
        return [sys.executable, str(WORKER), *worker_args]
    return torchrun(str(WORKER), *worker_args, processes=processes)


def _run_all(root: Path, launches: dict[str, tuple[int, Path, list[str]]]) -> None:
    """The runs named in `launches` (processes, output directory, worker arguments), side by side; fail (rather than
    wait) past the timeout, ending each run's whole process group (a rank stuck in a collective never exits)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    runs = {}
    for name, (processes, out, worker_args) in launches.items():
        log = open(root / f"{name}.log", "w")  # noqa: SIM115  # closed with the run below
        command = _command(processes, out, *worker_args)
        runs[name] = (
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
            log,
        )
    for name, (process, log) in runs.items():
        try:
            process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other, _ in runs.values():
                _end(other)
            raise TimeoutError(f"the {name} run took longer than {TIMEOUT_S} s") from None
        finally:
            log.close()
        text = (root / f"{name}.log").read_text()
        assert process.returncode == 0, f"the {name} run failed:\n{text[-4000:]}"


def _end(process: subprocess.Popen) -> None:
    """End a run that is still going: SIGTERM first, which torchrun passes on to its workers (they run in sessions of
    their own, so killing torchrun alone would leave them waiting on its store for ever), then SIGKILL."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def _result(out: Path, name: str = "result.pt") -> dict:
    return torch.load(out / name, weights_only=False) | {"model_dir": out / "model"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """The 2-process sharded run and the 1-process run of the `noisy` case."""
    root = tmp_path_factory.mktemp("fsdp2_trainer")
    _run_all(root, {f"world{n}": (n, root / f"world{n}", ["--case", "noisy"]) for n in (2, 1)})
    return {n: _result(root / f"world{n}") for n in (2, 1)}


def _relative(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over every tensor."""
    difference = sum((a[n].double() - b[n].double()).pow(2).sum() for n in b)
    return float((difference / sum(b[n].double().pow(2).sum() for n in b)).sqrt())


def test_the_run_was_sharded_over_two_processes(runs):
    sharded = runs[2]
    assert sharded["world_size"] == 2 and runs[1]["world_size"] == 1
    assert all(sharded["sharded"].values()), "each rank must hold only part of every parameter"
    assert sharded["global_step"] == runs[1]["global_step"] == worker.STEPS["noisy"]


def test_the_ranks_split_the_one_process_poisson_draws(runs):
    """The Poisson draw is global under the test seed, then split across ranks: the union of the ranks' logical
    batches is the one process's, step by step (what makes the released weights comparable at all)."""
    ranks, (single,) = runs[2]["samples"], runs[1]["samples"]
    assert len(single) == worker.STEPS["noisy"] and all(len(rank) == len(single) for rank in ranks)
    for step, batch in enumerate(single):
        drawn = [set(rank[step]) for rank in ranks]
        assert not drawn[0] & drawn[1], f"step {step}: an example drawn on both ranks"
        assert drawn[0] | drawn[1] == set(batch), f"step {step}: the ranks drew other examples than one process"


def test_released_weights_equal_the_one_process_run(runs):
    """Two chunks a process a step (gradient accumulation): after the first chunk the engine freezes the parameters
    for ghost differentiation, when FSDP2 no longer unshards the embedding in backward; its rule must not need it."""
    assert _relative(runs[2]["after"], runs[1]["after"]) <= 1e-5


def test_training_moved_the_weights(runs):
    before = dict(worker.tiny.llama().double().state_dict())
    assert _relative(runs[1]["after"], before) > 1e-3 and _relative(runs[2]["after"], before) > 1e-3


def test_the_ledger_and_its_accounting_equal_the_one_process_run(runs):
    """Under the test seed no number is labelled ε (invariant 10): the accountant's figure for a secret seed, and the
    saved ledger, must be the one process's."""
    sharded, single = runs[2]["report"], runs[1]["report"]
    assert sharded["steps"] == single["steps"] == worker.STEPS["noisy"]
    figure = [run["not_a_guarantee"]["accounting_with_a_secret_seed"]["value"] for run in (sharded, single)]
    assert figure[0] == pytest.approx(figure[1], rel=1e-12) and figure[0] > 0
    assert sharded["delta"] == single["delta"]
    ledgers = [json.loads((runs[n]["model_dir"] / "privacy_ledger.json").read_text()) for n in (2, 1)]
    assert ledgers[0] == ledgers[1]


def test_save_model_writes_one_full_checkpoint_that_loads_unsharded(runs):
    directory = runs[2]["model_dir"]
    weights = sorted(p.name for p in directory.glob("*.safetensors"))
    assert weights == ["model.safetensors"], weights
    saved = load_file(directory / "model.safetensors")
    after = runs[2]["after"]
    assert set(saved) <= set(after) and all(torch.equal(saved[n], after[n]) for n in saved)
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    assert type(model) is LlamaForCausalLM
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], after[n]) for n in after)
    assert {"dp_config.json", "README.md"} <= {p.name for p in directory.iterdir()}


def test_the_card_says_the_run_was_sharded(runs):
    card = runs[2]["card"]
    assert "FSDP2" in card and "over 2 processes" in card
    assert "FSDPLlama" not in card, "the card names the model's own class, not FSDP2's subclass"
    assert "FSDP2" not in runs[1]["card"]


# ---------------------------------------------------------------- checkpoints and resume
KILL_AT = 2  # after this step; the newest checkpoint is the step before (save_steps=1, saved after on_step_end)


@pytest.fixture(scope="module", params=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def resumed(request, tmp_path_factory) -> dict:
    """A sharded `checkpointed` run interrupted after step KILL_AT, then resumed from its newest checkpoint."""
    root = tmp_path_factory.mktemp(f"fsdp2_resume_{request.param}")
    out = root / "run"
    common = ["--case", "checkpointed", "--state-dict-type", request.param]
    _run_all(root, {"interrupted": (2, out, [*common, "--kill-at", str(KILL_AT)])})
    left = sorted(path.name for path in out.glob("checkpoint-*"))
    _run_all(root, {"resumed": (2, out, [*common, "--resume"])})
    return {
        "checkpoints_left": left,
        "interrupted": _result(out),
        "resumed": _result(out, "resumed.pt"),
        "out": out,
        "state_dict_type": request.param,
    }


def _ledger_file(directory: Path) -> dict:
    return json.loads((directory / "privacy_ledger.json").read_text())


def test_a_resumed_sharded_run_ends_with_the_ledger_of_an_uninterrupted_one(resumed, runs):
    """The uninterrupted run is the sharded `noisy` run (same data, batch, σ, C and steps; SGD instead of AdamW, which
    the ledger does not depend on). Its final weights are not compared: under the test seed the noise and sampling
    streams restart at a resume (a checkpoint keeps no secret stream, as in the DDP path: a secret run draws fresh
    OS entropy), so the resumed steps add other noise than the uninterrupted run's; the one-process resume test
    compares the ledger alone for the same reason."""
    interrupted, again = resumed["interrupted"], resumed["resumed"]
    assert interrupted["ledger_steps"] == interrupted["global_step"] == KILL_AT
    checkpoint = resumed["out"] / f"checkpoint-{KILL_AT - 1}"
    assert sum(m["steps"] for m in _ledger_file(checkpoint)["mechanisms"]) == KILL_AT - 1
    assert resumed["checkpoints_left"] == [checkpoint.name]
    assert again["global_step"] == again["ledger_steps"] == worker.STEPS["checkpointed"] == worker.STEPS["noisy"]
    assert again["epsilon"] == pytest.approx(runs[2]["epsilon"], rel=1e-12) and again["epsilon"] > 0
    assert _ledger_file(again["model_dir"]) == _ledger_file(runs[2]["model_dir"])
    for step in range(KILL_AT, worker.STEPS["checkpointed"] + 1):  # the step count continues, one checkpoint a step
        assert sum(m["steps"] for m in _ledger_file(resumed["out"] / f"checkpoint-{step}")["mechanisms"]) == step


def test_the_checkpoint_holds_the_state_dict_type_asked_for(resumed):
    checkpoint = resumed["out"] / f"checkpoint-{KILL_AT - 1}"
    names = {p.name for p in checkpoint.iterdir()}
    sharded_files = {"pytorch_model_fsdp_0", "optimizer_0"}
    full_files = {"pytorch_model_fsdp.bin", "optimizer.bin"}
    expected, other = (
        (sharded_files, full_files)
        if resumed["state_dict_type"] == "SHARDED_STATE_DICT"
        else (
            full_files,
            sharded_files,
        )
    )
    assert expected <= names and not other & names, names
    assert {"privacy_ledger.json", "dp_config.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names


def test_the_resumed_run_loads_the_weights_and_optimizer_state_that_were_saved(resumed):
    """Gathered from the shards when the checkpoint was written, and again once the resumed run has loaded it."""
    saved = resumed["interrupted"]["states"]["saved"][KILL_AT - 1]
    loaded = resumed["resumed"]["states"]["begin"]
    assert saved["model"].keys() == loaded["model"].keys()
    assert all(torch.equal(saved["model"][n], loaded["model"][n]) for n in saved["model"])
    before = dict(worker.tiny.llama().double().state_dict())
    assert _relative(saved["model"], before) > 0, "the saved weights must be a trained step's"
    state, state_loaded = saved["optimizer"]["state"], loaded["optimizer"]["state"]
    assert state.keys() == state_loaded.keys() == saved["model"].keys()
    for name, moments in state.items():
        assert moments.keys() == state_loaded[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(state_loaded[name][k])) for k, v in moments.items())
        assert float(moments["step"]) == KILL_AT - 1, "AdamW took exactly the run's steps (no step at save or load)"
    assert any(moments["exp_avg"].abs().max() > 0 for moments in state.values())


def test_a_resume_with_another_world_size_or_state_dict_type_is_refused(resumed):
    checkpoint = str(resumed["out"] / f"checkpoint-{KILL_AT - 1}")
    other = "FULL_STATE_DICT" if resumed["state_dict_type"] == "SHARDED_STATE_DICT" else "SHARDED_STATE_DICT"
    check_resumable(
        checkpoint, 2, FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=resumed["state_dict_type"])
    )
    for processes, kind in ((4, resumed["state_dict_type"]), (2, other)):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
        with pytest.raises(
            ValueError, match="resume a sharded run with the number of processes and the state_dict_type"
        ):
            check_resumable(checkpoint, processes, plugin)


# ---------------------------------------------------------------- the budget
@pytest.fixture(scope="module")
def budget(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp2_budget")
    _run_all(root, {"budget": (2, root / "budget", ["--case", "budget"])})
    return _result(root / "budget")


def test_a_sharded_run_stops_before_the_budget_is_exceeded(budget):
    """tests/trainer/test_trainer.py::test_training_stops_before_the_budget_is_exceeded, sharded over 2 processes."""
    planned, asked = worker.STEPS["budget"], worker.BUDGET_ASKED
    assert budget["epsilon"] <= worker.BUDGET_EPSILON
    assert planned <= budget["ledger_steps"] < asked
    assert budget["global_step"] == budget["ledger_steps"]  # no empty step after the stop
    text = "\n".join(budget["warnings"])
    assert f"fewer than the {asked} asked for" in text  # said before step 1
    assert f"calibrated for the {planned} steps planned at construction; TrainingArguments now asks for {asked}" in text
    assert text.count(f"Privacy budget reached after {budget['ledger_steps']} of the {asked} steps asked for") == 1


# ---------------------------------------------------------------- sensitivity through PrivateTrainer
@pytest.fixture(scope="module")
def neighbours(runs, tmp_path_factory) -> dict:
    """`clipped` and `neighbour` (noise off, one step) with the scaled example one that the test seed's first Poisson
    draw takes (the `noisy` run's first batch: same seed, data and rate)."""
    scaled = min(index for rank in runs[2]["samples"] for index in rank[0])
    root = tmp_path_factory.mktemp("fsdp2_sensitivity")
    launches = {case: (2, root / case, ["--case", case, "--scaled", str(scaled)]) for case in ("clipped", "neighbour")}
    _run_all(root, launches)
    return {case: _result(root / case) for case in launches} | {"scaled": scaled}


def test_one_examples_gradient_moves_the_released_sum_by_at_most_C(neighbours):
    """Neighbouring datasets through the public API: one example's loss weighted 1e-6 in one, 1e6 in the other
    (`per_example_loss`), so its gradient grows 10^12-fold. With the noise off, the released update of the one step is
    −lr·Σ clipped / (expected batch), gathered across the shards over the whole model: the clipped sums differ by at
    most C. The scaled example's clipped term goes from almost nothing to norm C, so the sum moves by almost exactly C
    (the bound is tight here); without the clip it would move by 10^6 times the example's gradient norm."""
    clipped, neighbour = neighbours["clipped"], neighbours["neighbour"]
    for run in (clipped, neighbour):
        assert any(neighbours["scaled"] in rank[0] for rank in run["samples"]), "the scaled example must be drawn"
        assert run["world_size"] == 2 and all(run["sharded"].values())
    difference = sum((clipped["after"][n] - neighbour["after"][n]).double().pow(2).sum() for n in clipped["after"])
    moved = float(difference.sqrt()) * clipped["expected_batch"] / worker.LEARNING_RATE
    assert moved <= worker.CLIP * (1 + 1e-6)
    assert moved > 0.99 * worker.CLIP
