"""Sharded (FSDP2) `privatize(SFTTrainer)` and `privatize(DPOTrainer)` (issue 49): two gloo processes as
`torchrun --nproc-per-node 2` starts them against one unsharded process with the same arguments and test seed
(tests/support/fsdp2_trl_worker.py, launched as tests/trainer/test_fsdp2_trainer.py launches its worker). DPO with a
separate reference model shards it as TRL does under FSDP2; DPO on a LoRA adapter uses the base with the adapter
disabled as its reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trl import DPOConfig, SFTConfig

from hf_private import DPConfig
from hf_private.trainer.sharded import check_sharding
from tests.support import fsdp2_trl_worker as worker
from tests.support import tiny
from tests.support.fsdp2_lora_worker import LORA
from tests.support.helpers import TRL_TEST_ARGS
from tests.trainer import test_fsdp2_trainer as launch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TOLERANCE = 1e-5  # the bound on the released update, sharded against one process, relative


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Each case's 2-process sharded run and 1-process run, all side by side."""
    root = tmp_path_factory.mktemp("fsdp2_trl")
    launches = {
        f"{case}-world{n}": (n, root / f"{case}-world{n}", ["--case", case]) for case in worker.CASES for n in (2, 1)
    }
    with pytest.MonkeyPatch.context() as patch:  # the launcher of the trainer tests, pointed at this worker
        patch.setattr(launch, "WORKER", Path(worker.__file__))
        launch._run_all(root, launches)
    return {case: {n: launch._result(root / f"{case}-world{n}") for n in (2, 1)} for case in worker.CASES}


def initial(case: str) -> dict[str, torch.Tensor]:
    """The case's weights before training, as the worker builds them."""
    model = tiny.llama().double()
    if case == "dpo-lora":
        model = get_peft_model(model, LoraConfig(**LORA))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _relative(a: dict, b: dict, names: list[str]) -> float:
    """‖a − b‖ / ‖b‖ over the tensors `names`."""
    difference = sum((a[n].double() - b[n].double()).pow(2).sum() for n in names)
    return float((difference / sum(b[n].double().pow(2).sum() for n in names)).sqrt())


@pytest.mark.parametrize("case", worker.CASES)
def test_the_released_update_equals_the_one_process_run(runs, case):
    """Every trained tensor (the adapter, for LoRA) after training, gathered from the shards, is the one process's;
    the runs were sharded, and training moved the weights by more than the tolerance."""
    sharded, single = runs[case][2], runs[case][1]
    assert sharded["world_size"] == 2 and single["world_size"] == 1
    assert sharded["global_step"] == single["global_step"] == worker.STEPS
    trained = sharded["trainable"]
    assert trained == single["trainable"] and trained
    assert all(sharded["sharded"][name] for name in trained), "each rank must hold only part of every trained tensor"
    assert _relative(sharded["after"], single["after"], trained) <= TOLERANCE
    assert _relative(sharded["after"], initial(case), trained) > TOLERANCE  # else the comparison says nothing


def test_the_dpo_reference_model_is_sharded_and_not_trained(runs):
    """The separate reference model is sharded as the policy is (each rank holds part of every tensor), and its
    weights after training are those it started with, in both runs."""
    sharded, single = runs["dpo"][2], runs["dpo"][1]
    assert sharded["reference_sharded"] and all(sharded["reference_sharded"].values())
    assert not any(single["reference_sharded"].values())
    before = initial("dpo")
    for run in (sharded, single):
        assert run["reference"].keys() == before.keys()
        assert all(torch.equal(run["reference"][name], before[name]) for name in before)


def test_with_lora_the_reference_is_the_frozen_base_which_stays_as_it_was(runs):
    """No separate reference model: the base with the adapter disabled is the reference; it is sharded, frozen, and
    unchanged by training."""
    sharded = runs["dpo-lora"][2]
    assert not sharded["reference"]
    before = initial("dpo-lora")
    base = [name for name in before if name not in sharded["trainable"]]
    assert base and all(sharded["sharded"][name] for name in base)
    assert all(torch.equal(sharded["after"][name], before[name]) for name in base)


@pytest.mark.parametrize("case", worker.CASES)
def test_the_ledger_and_the_report_equal_the_one_process_run(runs, case):
    sharded, single = runs[case][2], runs[case][1]
    assert sharded["ledger_steps"] == single["ledger_steps"] == worker.STEPS
    assert sharded["report"] == single["report"]
    assert sharded["report"]["unit"] == ("prompt-completion pair" if case == "sft" else "preference pair")
    assert sharded["report"]["trainer"] == ("trl.SFTTrainer" if case == "sft" else "trl.DPOTrainer")
    ledgers = [json.loads((run["model_dir"] / "privacy_ledger.json").read_text()) for run in (sharded, single)]
    assert ledgers[0] == ledgers[1]
    card = (sharded["model_dir"] / "README.md").read_text()
    assert "FSDP2" in card and "over 2 processes" in card


@pytest.mark.parametrize(
    ("config_class", "setting", "named"),
    [
        (SFTConfig, {"packing": True}, "TRL's packing and padding_free"),
        (SFTConfig, {"padding_free": True}, "TRL's packing and padding_free"),
        (DPOConfig, {"precompute_ref_log_probs": True}, "DPO's precompute_ref_log_probs"),
        (DPOConfig, {"sync_ref_model": True}, "DPO's sync_ref_model"),
    ],
)
def test_what_stays_refused_with_trl_under_sharding(tmp_path, config_class, setting, named):
    """TRL's configurations pass the table (one process is then refused); these settings, untested sharded, do not."""
    settings = dict(TRL_TEST_ARGS, fsdp=True, fsdp_config={"fsdp_version": 2})
    dp_config = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="FSDP2 with one process shards nothing"):
        check_sharding(config_class(str(tmp_path), **settings), tiny.llama(), dp_config)
    with pytest.raises(NotImplementedError, match=named):
        check_sharding(config_class(str(tmp_path), **settings, **setting), tiny.llama(), dp_config)
