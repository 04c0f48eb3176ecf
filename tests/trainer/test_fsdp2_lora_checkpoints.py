"""Checkpoints of sharded DP-LoRA (issue 49): a sharded `PeftModel` run (tests/support/fsdp2_trainer_worker.py's
`checkpointed` case with `--lora`) interrupted after step KILL_AT and resumed from its newest checkpoint, in both
`state_dict_type`s: the adapter and AdamW's state are loaded as they were saved, and the ledger goes on counting."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import fsdp2_trainer_worker as worker
from tests.trainer.test_fsdp2_trainer import KILL_AT, _result, _run_all

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", params=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def resumed(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"fsdp2_lora_resume_{request.param}")
    out = root / "run"
    common = ["--case", "checkpointed", "--lora", "--state-dict-type", request.param]
    _run_all(root, {"interrupted": (2, out, [*common, "--kill-at", str(KILL_AT)])})
    _run_all(root, {"resumed": (2, out, [*common, "--resume"])})
    return {"interrupted": _result(out), "resumed": _result(out, "resumed.pt"), "out": out}


def _ledger_steps(directory) -> int:
    return sum(m["steps"] for m in json.loads((directory / "privacy_ledger.json").read_text())["mechanisms"])


def test_a_resumed_sharded_lora_run_continues_the_ledger(resumed):
    interrupted, again = resumed["interrupted"], resumed["resumed"]
    assert interrupted["ledger_steps"] == interrupted["global_step"] == KILL_AT
    assert again["global_step"] == again["ledger_steps"] == worker.STEPS["checkpointed"]
    for step in range(KILL_AT - 1, worker.STEPS["checkpointed"] + 1):
        assert _ledger_steps(resumed["out"] / f"checkpoint-{step}") == step
    assert _ledger_steps(again["model_dir"]) == worker.STEPS["checkpointed"] and again["epsilon"] > 0


def test_the_resumed_run_loads_the_adapter_and_optimizer_state_that_were_saved(resumed):
    saved = resumed["interrupted"]["states"]["saved"][KILL_AT - 1]
    loaded = resumed["resumed"]["states"]["begin"]
    assert saved["model"].keys() == loaded["model"].keys()
    assert all(torch.equal(saved["model"][n], loaded["model"][n]) for n in saved["model"])
    trained = {n for n in saved["model"] if "lora_" in n}
    assert trained and saved["optimizer"]["state"].keys() == loaded["optimizer"]["state"].keys() == trained
    for name, moments in saved["optimizer"]["state"].items():
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(loaded["optimizer"]["state"][name][k]))
            for k, v in moments.items()
        )
        assert float(moments["step"]) == KILL_AT - 1, "AdamW took exactly the run's steps (no step at save or load)"
    assert any(saved["model"][n].abs().max() > 0 for n in trained if "lora_B" in n), (
        "lora_B starts at 0: a step moved it"
    )


def test_checkpoints_and_the_final_save_hold_the_adapter(resumed):
    for directory in (resumed["out"] / f"checkpoint-{KILL_AT - 1}", resumed["resumed"]["model_dir"]):
        names = {p.name for p in directory.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "privacy_ledger.json"} <= names, names
