"""push_to_hub → fresh download → load → identical logits and the same privacy block, against a loopback fake Hub.

The client runs in a subprocess (tests/support/hub_scenario.py): huggingface_hub reads HF_ENDPOINT when it is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from huggingface_hub import ModelCard

from tests.support.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_UNHANDLED = {"GET /api/agent-harnesses"}  # asked for at import; a 404 is what the real Hub may say too
# hub_strategy → how many commits: the final push only; or also from checkpoints (one skipped while another is busy).
COMMITS = {"end": range(1, 2), "every_save": range(2, 4)}
JUNK = {"all_results.json", "notes.txt", "runs", "train_results.json", "trainer_state.json", "training_args.bin"}
ALLOW_LISTED_BITFIT = {
    "private_adapter.safetensors",
    "dp_config.json",
    "privacy_ledger.json",
    "README.md",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _steps(block: dict) -> int:
    return sum(m["steps"] for m in block["mechanisms"])


def _run_scenario(hub: FakeHub, tmp_path: Path, *strategies: str) -> dict:
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "hf_fake",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.hub_scenario", str(tmp_path), *strategies],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_push_download_load_and_read_the_card(tmp_path):
    with FakeHub() as hub:
        findings = _run_scenario(hub, tmp_path)

        bitfit = hub.repos["me/tiny-bitfit-dp"]
        assert {"private_adapter.safetensors", "dp_config.json", "privacy_ledger.json", "README.md"} <= set(bitfit)
        assert "model.safetensors" not in bitfit and not any(p.startswith("checkpoint-") for p in bitfit)
        states = [files for repo, files in hub.history if repo == "me/tiny-bitfit-dp" and "README.md" in files]
        assert len(states) >= 2, "expected a push from a checkpoint and the final push"
        for files in states:  # after every commit, the card describes the adapter and ledger beside it
            assert "private_adapter.safetensors" in files
            card_steps = _steps(ModelCard(files["README.md"].decode()).data.to_dict()["privacy"])
            assert card_steps == _steps(json.loads(files["privacy_ledger.json"])) > 0
        lora = hub.repos["me/demo-lora-dp"]
        assert {"adapter_model.safetensors", "adapter_config.json", "dp_config.json", "README.md"} <= set(lora)
        for repo in ("me/tiny-sft-dp", "me/tiny-dpo-dp"):  # TRL's trainers: the adapter and card, nothing else
            assert {"adapter_model.safetensors", "adapter_config.json", "dp_config.json", "README.md"} <= set(
                hub.repos[repo]
            ), (repo, sorted(hub.repos[repo]))
            assert not set(hub.repos[repo]) & JUNK, sorted(hub.repos[repo])
        assert set(hub.unhandled) <= EXPECTED_UNHANDLED, hub.unhandled
    assert "private_adapter.safetensors" in findings["bitfit_files"]
    assert 0 < findings["sft_epsilon"] <= 8.0 and 0 < findings["dpo_epsilon"] <= 8.0
    assert 0 < findings["bitfit_epsilon"] <= 3.0 and 0 < findings["lora_epsilon"] <= 8.0


def test_push_uploads_only_allow_listed_files(tmp_path):
    """Every file that ever reached the fake Hub, over all commits, is on the allow-list, whatever the output holds."""
    with FakeHub() as hub:
        listings = _run_scenario(hub, tmp_path, *COMMITS)
        commits = {
            strategy: [files for repo, files in hub.history if repo == f"me/tiny-{strategy}"] for strategy in COMMITS
        }
    for strategy, listing in listings.items():
        assert JUNK <= set(listing), f"{strategy}: the scenario must leave junk in the output directory"
        assert len(commits[strategy]) in COMMITS[strategy], f"{strategy}: {len(commits[strategy])} commits"
    uploaded = {strategy: sorted(set().union(*states)) for strategy, states in commits.items()}
    assert uploaded == {strategy: sorted(ALLOW_LISTED_BITFIT) for strategy in COMMITS}
