"""Distributed DP (issue 8): two CPU processes under `accelerate launch` (gloo) against one process.

Each launch runs tests/support/distributed_worker.py; see its docstring for the two cases.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support import distributed_worker as worker
from tests.support.launch import accelerate_launch

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["full", "lora", "bitfit", "frost", "rgp", "users", "users-els", "frost-users"]
# RGP's update is a projection of the released noise onto its carriers, not the noise itself (test_sparse_lowrank.py)
NOISE_IS_THE_UPDATE = [m for m in METHODS if m != "rgp"]


def _launch(method: str, cases: list[str], out: Path) -> dict[str, list[dict]]:
    """Each case's (rank 0, rank 1) results, from one two-process launch running the cases in turn."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = accelerate_launch(
        str(ROOT / "tests" / "support" / "distributed_worker.py"),
        "--method",
        method,
        "--case",
        *cases,
        "--out",
        str(out),
    )
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {case: [torch.load(out / case / f"rank{r}.pt", weights_only=False) for r in range(2)] for case in cases}


def _one_process(method: str, case: str, out: Path) -> dict:
    with worker.patches_undone():
        worker.run(method, case, out, world_size=1)
    return torch.load(out / "rank0.pt", weights_only=False)


@pytest.fixture(scope="module", params=METHODS)
def launched(request, tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """A method's two-process runs of the update case and (where the update is the noise) the noise case."""
    method = request.param
    cases = ["update", "noise"] if method in NOISE_IS_THE_UPDATE else ["update"]
    return method, _launch(method, cases, tmp_path_factory.mktemp(f"{method}-2proc"))


@pytest.fixture(scope="module")
def update_runs(launched, tmp_path_factory):
    """(rank 0, rank 1, one-process reference) of three noise-free steps on the same logical batches."""
    method, runs = launched
    return method, runs["update"], _one_process(method, "update", tmp_path_factory.mktemp(f"{method}-1proc"))


def test_ranks_hold_identical_parameters(update_runs):
    _, (rank0, rank1), _ = update_runs
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["wrapped"] == "DistributedDataParallel", "the run must actually be DDP"
    moved = [n for n in rank0["after"] if not torch.equal(rank0["after"][n], rank0["before"][n])]
    assert moved, "training changed nothing"
    assert all(torch.equal(rank0["after"][n], rank1["after"][n]) for n in rank0["after"])


def test_two_processes_update_like_one(update_runs):
    """Same logical batches (test-mode sampling), no noise: the clipped sums are reduced, not averaged or lost."""
    method, (rank0, rank1), single = update_runs
    assert single["world_size"] == 1 and rank0["global_step"] == single["global_step"] == 3
    difference = sum((rank0["after"][n] - single["after"][n]).pow(2).sum() for n in single["after"]).sqrt()
    update = sum((single["after"][n] - single["before"][n]).pow(2).sum() for n in single["after"]).sqrt()
    assert update > 0
    assert (difference / update).item() <= 1e-6
    # A method's own releases (DP-FROST's 5 selection rounds, noise off): each rank measures its shard of the Poisson
    # sample and the release is their sum, the one-process release (a missing all-reduce would halve it).
    assert len(rank0["releases"]) == len(single["releases"]) == (5 if method.startswith("frost") else 0)
    for mine, theirs, reference in zip(rank0["releases"], rank1["releases"], single["releases"]):
        assert torch.equal(mine, theirs) and reference.abs().sum() > 0
        torch.testing.assert_close(mine, reference, rtol=1e-9, atol=0)


def test_ledger_and_epsilon_identical_on_ranks_and_global(update_runs):
    method, (rank0, rank1), single = update_runs
    assert rank0["report"] == rank1["report"]
    # at user level N counts users (ULS) or the examples users keep (ELS)
    units = {"users": worker.USERS, "frost-users": worker.USERS, "users-els": worker.KEPT}.get(
        method, worker.DATASET_SIZE
    )
    assert rank0["report"]["sample_rate"] == worker.LOGICAL_BATCH / units  # global q, not per rank
    assert rank0["report"]["steps"] == rank0["global_step"]  # one ledger step per logical batch
    # test-mode sampling: no guarantee, so the accounting is under not_a_guarantee (the same numbers)
    figure = "accounting_with_a_secret_seed"
    assert rank0["report"]["not_a_guarantee"][figure]["value"] == pytest.approx(
        single["report"]["not_a_guarantee"][figure]["value"], rel=1e-12
    )


def test_card_ledger_and_weights_written_once(update_runs):
    _, (rank0, rank1), _ = update_runs
    assert rank0["calls"]["card"] >= 1 and rank0["calls"]["ledger"] >= 1 and rank0["calls"]["model"] >= 1
    assert rank1["calls"] == {"card": 0, "ledger": 0, "model": 0}


def test_rgp_carriers_agree_on_every_rank_without_a_test_seed(tmp_path):
    """The carriers' start vectors come from OS entropy drawn on rank 0 and broadcast: without the broadcast each rank
    would project the (identical) released gradients onto different carriers and the weights would drift apart."""
    rank0, rank1 = _launch("rgp-entropy", ["update"], tmp_path)["update"]
    assert rank0["wrapped"] == "DistributedDataParallel"
    moved = [n for n in rank0["after"] if not torch.equal(rank0["after"][n], rank0["before"][n])]
    assert moved and all(torch.equal(rank0["after"][n], rank1["after"][n]) for n in rank0["after"])


@pytest.mark.parametrize("launched", NOISE_IS_THE_UPDATE, indirect=True)
def test_noise_is_added_exactly_once(launched):
    """Zero loss: the update is the noise alone, so (update·qN)² averages σ²C² — not 2σ²C² (noise on every rank)
    and not 0 (no noise). Tolerance: 5 standard errors of a mean of squared standard normals."""
    _, runs = launched
    rank0, rank1 = runs["noise"]
    assert all(torch.equal(rank0["after"][n], rank1["after"][n]) for n in rank0["after"])
    noise = torch.cat([(rank0["after"][n] - rank0["before"][n]).flatten() for n in rank0["after"]])
    noise = noise * worker.LOGICAL_BATCH / worker.LEARNING_RATE["noise"]  # undo the q·N division and the lr
    expected = (worker.NOISE_MULTIPLIER * worker.CLIP) ** 2
    ratio = noise.pow(2).mean().item() / expected
    assert abs(ratio - 1) <= 5 * math.sqrt(2 / noise.numel()), (ratio, noise.numel())


def test_adaptive_clipping_count_is_released_once(tmp_path):
    """Adaptive clipping under a test seed: each rank counts its shard of the batch, the count is summed and noised
    once, so both ranks release the same noisy count and move C alike, and the whole C trajectory is the one-process
    run's (noise drawn on every rank would add it twice; a count left unsummed would see half the batch)."""
    rank0, rank1 = _launch("adaptive", ["count"], tmp_path / "2proc")["count"]
    single = _one_process("adaptive", "count", tmp_path / "1proc")["counts"]
    steps = worker.STEPS["count"]
    assert rank0["wrapped"] == "DistributedDataParallel" and rank0["global_step"] == steps
    assert len(single["clip"]) == len(rank0["counts"]["clip"]) == steps
    mine, theirs = rank0["counts"], rank1["counts"]
    assert mine["released"] == theirs["released"] and mine["clip"] == theirs["clip"]
    # the ranks' exact shares add up to the one-process count, and the released fraction is that count plus noise
    exact = [a + b for a, b in zip(mine["exact"], theirs["exact"])]
    assert exact == pytest.approx(single["exact"], abs=1e-9)
    assert len(set(single["clip"])) == steps  # C moved every step
    noiseless = [count / worker.LOGICAL_BATCH + 0.5 for count in exact]
    assert all(abs(r - f) > 1e-6 for r, f in zip(mine["released"], noiseless)), "the count was released unnoised"
    assert mine["released"] == pytest.approx(single["released"], abs=1e-6)
    assert mine["clip"] == pytest.approx(single["clip"], rel=1e-6)
