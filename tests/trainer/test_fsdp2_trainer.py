"""Sharded (FSDP2) private training through `PrivateTrainer` (issue 49): two gloo processes launched as a user
without a GPU would (`torchrun --nproc-per-node 2`, `TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2},
use_cpu=True)`) against one unsharded process with the same arguments and test seed (tests/support/
fsdp2_trainer_worker.py). Both runs are subprocesses: the worker patches the sampler to record its draws.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from tests.support import fsdp2_trainer_worker as worker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

WORKER = Path(worker.__file__)
TIMEOUT_S = 300  # both runs together; they take well under a minute on an idle machine


def _command(processes: int, out: Path) -> list[str]:
    if processes == 1:
        return [sys.executable, str(WORKER), "--case", "noisy", "--out", str(out)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(WORKER),
        "--case",
        "noisy",
        "--out",
        str(out),
    ]


def _run_both(root: Path) -> dict[int, dict]:
    """The 2-process sharded run and the 1-process run, side by side; fail (rather than wait) past the timeout,
    ending each run's whole process group (a rank stuck in a collective never exits by itself)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    runs = {}
    for processes in (2, 1):
        out = root / f"world{processes}"
        log = open(root / f"world{processes}.log", "w")  # noqa: SIM115  # closed with the run below
        runs[processes] = (
            subprocess.Popen(
                _command(processes, out), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            ),
            out,
            log,
        )
    results = {}
    for processes, (process, out, log) in runs.items():
        try:
            process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other, _, _ in runs.values():
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            raise TimeoutError(f"the {processes}-process run took longer than {TIMEOUT_S} s") from None
        finally:
            log.close()
        text = (root / f"world{processes}.log").read_text()
        assert process.returncode == 0, f"the {processes}-process run failed:\n{text[-4000:]}"
        results[processes] = torch.load(out / "result.pt", weights_only=False) | {"model_dir": out / "model"}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return _run_both(tmp_path_factory.mktemp("fsdp2_trainer"))


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
