"""The numbers of every method, pinned: σ, ε and (under a test seed) the released updates, bit for bit.

A restructuring must not change what a run releases. Each row trains a tiny model for a few steps under an insecure
test seed (so noise and sampling replay) and compares the calibrated σ, the ledger's ε and a SHA-256 of every trained
tensor after training with `pinned_numbers.json`, written by the code before the restructuring
(`python -m tests.test_pinned_numbers --write` rewrites it: only for a change that is meant to change the numbers).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_private import BitFitConfig, DPConfig, DPFPConfig, DPLoRAConfig, FrostConfig, SparseLowRankConfig
from tests import tiny
from tests.helpers import make_trainer

PINNED = Path(__file__).with_name("pinned_numbers.json")
SEED = 20261125
SHARED = dict(max_grad_norm=0.5, noise_seed=SEED)
# row → (config, tiny model factory); target_epsilon rows pin the calibration too
ROWS = {
    "dp-sgd": (DPConfig(target_epsilon=3.0, **SHARED), tiny.bert),
    "dp-lora": (DPLoRAConfig(noise_multiplier=0.8, lora_r=2, lora_target_modules="query,value", **SHARED),
                tiny.bert),
    "dp-bitfit": (BitFitConfig(target_epsilon=5.0, **SHARED), tiny.roberta),
    "dp-bitfit/x": (BitFitConfig(target_epsilon=5.0, full_finetune_epochs=1.0, **SHARED), tiny.roberta),
    "dp-frost": (FrostConfig(target_epsilon=4.0, unfreeze_ratio=0.3, selection_sample_rate=0.25, **SHARED),
                 tiny.bert),
    "sparse-lowrank": (SparseLowRankConfig(noise_multiplier=0.8, rank=4, sparsity=0.25, **SHARED), tiny.bert),
    "sparse-lowrank/rgp": (SparseLowRankConfig(noise_multiplier=0.8, variant="rgp", rank=2, sparsity=0.25, **SHARED),
                           tiny.bert),
    "dp-fp": (DPFPConfig(target_epsilon=4.0, **SHARED), tiny.bert),
    "dp-fp/paper": (DPFPConfig(noise_multiplier=0.8, mode="paper", **SHARED), tiny.bert),
}


def run_row(name: str, output_dir) -> dict:
    config, factory = ROWS[name]
    torch.manual_seed(0)
    trainer = make_trainer(output_dir, model=factory(), dataset=tiny.sentiment_dataset(64, seed=1), dp=config,
                           num_train_epochs=2, learning_rate=5e-2)
    sigmas = [stage.noise_multiplier for stage in trainer.plan.planned]
    trainer.train()
    digest = hashlib.sha256()
    for tensor_name, param in sorted(trainer.model.named_parameters()):
        if tensor_name in trainer.trained_parameter_names:
            digest.update(tensor_name.encode())
            digest.update(param.detach().to(torch.float64).numpy().tobytes())
    epsilon = trainer.ledger.epsilon()
    return {
        "sigmas": [None if s is None else float(s).hex() for s in sigmas],
        "epsilon": float(epsilon).hex(),
        "steps": trainer.training_steps(),
        "mechanisms": [[group.name, group.steps] for group in trainer.ledger.mechanisms],
        "trained_tensors": len(trainer.trained_parameter_names),
        "updates_sha256": digest.hexdigest(),
    }


@pytest.mark.parametrize("name", sorted(ROWS))
def test_numbers_are_the_pinned_ones(tmp_path, name):
    pinned = json.loads(PINNED.read_text())[name]
    assert run_row(name, tmp_path) == pinned


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        numbers = {name: run_row(name, Path(directory) / name) for name in sorted(ROWS)}
    PINNED.write_text(json.dumps(numbers, indent=1, sort_keys=True) + "\n")
    print(json.dumps(numbers, indent=1))
