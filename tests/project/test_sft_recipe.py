"""recipes/sft.py: the offline DP SFT and DPO recipe (privatize(trl.SFTTrainer) or privatize(trl.DPOTrainer) beside
the stock trainer), its generated instruction and preference tasks, and a 2-process `accelerate launch` of each that
ends with identical ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_private.demos import instruction as instruction_demo
from tests.support.launch import accelerate_launch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))
import sft  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

QUIET = ["--disable_tqdm", "true", "--accountant", "rdp"]
SMALL = ["--train_size", "512", "--eval_size", "20", "--num_train_epochs", "1", "--expected_batch_size", "64", *QUIET]


def test_task_is_generated_deterministically_and_held_out():
    data = instruction_demo.instruction_splits(300, 50, seed=7)
    again = instruction_demo.instruction_splits(300, 50, seed=7)
    assert data["train"].to_dict() == again["train"].to_dict()
    assert not set(data["validation"]["prompt"]) & set(data["train"]["prompt"])
    tok = instruction_demo.instruction_tokenizer()
    for prompt, completion in zip(data["train"]["prompt"], data["train"]["completion"]):
        instruction, _, review = prompt.split(" ", 2)
        assert instruction in instruction_demo.INSTRUCTIONS and completion.startswith(" ")
        assert tok.unk_token_id not in tok(prompt + completion)["input_ids"]
        if instruction != "verdict":
            assert completion.strip() == review.split()[-1 if instruction == "last" else 0]
        else:
            assert completion.strip() in instruction_demo.VERDICTS
    assert 0 < instruction_demo.majority_exact_match(data["train"], data["validation"]) < 0.5


def test_default_run_is_offline_and_prints_epsilon_and_both_metrics(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = sft.main(["--output_dir", str(tmp_path), *SMALL])
    table = capsys.readouterr().out
    assert 0 < result["epsilon"] <= 8.0 and result["steps"] == result["non_private_steps"] == 8
    for key in ("private_exact_match", "non_private_exact_match", "baseline_exact_match"):
        assert 0.0 <= result[key] <= 1.0
    assert re.search(r"private \(sft, dp-sgd\)\s+8\.00\s+9\.8e-04\s+8\s+\d\.\d{3}", table), table
    assert re.search(r"non-private\s+∞\s+-\s+8\s+\d\.\d{3}", table) and "trivial (majority answer)" in table
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "privacy_ledger.json").is_file()
    privacy = ModelCard.load(tmp_path / "README.md").data.to_dict()["privacy"]
    assert privacy["epsilon"] == pytest.approx(result["epsilon"]) and privacy["guarantee"] == "formal"
    assert privacy["unit"] == "prompt-completion pair"


def test_preference_pairs_are_generated_deterministically_with_a_wrong_rejected_answer():
    data = instruction_demo.preference_splits(300, 50, seed=7)
    assert data["train"].to_dict() == instruction_demo.preference_splits(300, 50, seed=7)["train"].to_dict()
    assert not set(data["validation"]["prompt"]) & set(data["train"]["prompt"])
    for prompt, chosen, rejected in zip(data["train"]["prompt"], data["train"]["chosen"], data["train"]["rejected"]):
        instruction, _, review = prompt.split(" ", 2)
        assert chosen != rejected and chosen.startswith(" ") and rejected.startswith(" ")
        if instruction != "verdict":
            assert chosen.strip() == review.split()[-1 if instruction == "last" else 0]


def test_dpo_run_prints_epsilon_and_both_metrics_and_names_the_pair_as_unit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = sft.main(["--trainer", "dpo", "--output_dir", str(tmp_path), *SMALL])
    table = capsys.readouterr().out
    assert 0 < result["epsilon"] <= 8.0 and result["steps"] == result["non_private_steps"] == 8
    for key in (
        "private_exact_match",
        "non_private_exact_match",
        "private_preference_accuracy",
        "non_private_preference_accuracy",
    ):
        assert 0.0 <= result[key] <= 1.0
    assert re.search(r"private \(dpo, dp-sgd\)\s+8\.00\s+9\.8e-04\s+8\s+\d\.\d{3}\s+\d\.\d{3}", table), table
    privacy = ModelCard.load(tmp_path / "README.md").data.to_dict()["privacy"]
    assert privacy["unit"] == "preference pair" and privacy["epsilon"] == pytest.approx(result["epsilon"])


def test_lora_writes_a_peft_adapter(tmp_path):
    result = sft.main(["--output_dir", str(tmp_path), "--lora", "true", "--non_private", "false", *SMALL])
    assert result["steps"] == 8 and "non_private_exact_match" not in result
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "README.md").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainer", "ppo"], "--trainer must be sft or dpo"),
        (["--method", "adam"], "--method must be one of"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        sft.main(["--output_dir", str(tmp_path), *argv])


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_two_process_accelerate_launch_ends_with_identical_ranks(tmp_path, trainer):
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    command = accelerate_launch("recipes/sft.py", "--trainer", trainer, "--output_dir", str(tmp_path), *SMALL)
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    digests = dict(re.findall(r"^rank (\d) of 2: (.+)$", run.stderr, re.MULTILINE))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], digests
    assert run.stdout.count("non-private") == 1  # the table is printed once, by the main process
    privacy = ModelCard.load(tmp_path / "README.md").data.to_dict()["privacy"]
    assert sum(m["steps"] for m in privacy["mechanisms"]) == 8
