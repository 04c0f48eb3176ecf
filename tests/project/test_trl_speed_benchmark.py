"""Smoke test of `benchmarks.trl_speed` on a tiny Llama (2 layers, width 32, T = 16), every arm run in this process
(the benchmark runs each in a fresh one): the SFT rows reach the JSON with their steps, examples, peak memory and
privacy report, `--resume` skips them, and the non-private DPO arm trains on pairs of exactly T tokens a row.
No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import trl_speed

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = [
    "--seq-len",
    "16",
    "--vocab-size",
    "64",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--intermediate",
    "64",
    "--batch-size",
    "2",
    "--steps",
    "2",
    "--rounds",
    "1",
    "--threads",
    "1",
]


def test_sft_rows_reach_the_json_and_resume_skips_them(tmp_path):
    out = str(tmp_path / "trl_speed.json")
    # The private arm measures from the step after its first Poisson batch of >= 2 sequences (the independence
    # probe's): at an expected batch of 4 and 4 spare steps, 5 batches in a row of < 2 happen about once in 10^5 runs
    # (at 2 and 2 spare, about once in 10 — the sampler is the secret one, so the test cannot fix its draw).
    argv = [
        *TINY,
        "--batch-size",
        "4",
        "--spare",
        "4",
        "--trainer",
        "sft",
        "--modes",
        "full",
        "lora",
        "--arms",
        "non-private",
        "private",
        "plain-loss",
        "--out",
        out,
    ]
    rows = trl_speed.main(argv, run_arm_with=trl_speed.run_arm)
    saved = json.loads(open(out).read())["results"]
    assert (
        [(row["trainer"], row["mode"]) for row in saved]
        == [("sft", "full"), ("sft", "lora")]
        == [(row["trainer"], row["mode"]) for row in rows]
    )
    trainable = {}
    for row in saved:
        assert row["time_ratio"] > 0 and row["memory_ratio"] > 0 and row["expected_batch"] == 4
        assert row["plain_time_ratio"] > 0 and row["plain_memory_ratio"] > 0
        public, private = row["arms"]["non-private"]["runs"][0], row["arms"]["private"]["runs"][0]
        for reference in (public, row["arms"]["plain-loss"]["runs"][0]):
            assert reference["step_examples"] == [4] * len(reference["step_seconds"])
            assert reference["warmup_steps_run"] == 1
        # the plain-loss reference trains without TRL's fused LM head, so SFT's metrics are not logged
        assert "entropy" in public["log_history"][0]
        assert "entropy" not in row["arms"]["plain-loss"]["runs"][0]["log_history"][0]
        measured = private["step_examples"][private["warmup_steps_run"] :]
        assert len(measured) == 2 and private["s_per_example"] == pytest.approx(
            sum(private["step_seconds"][private["warmup_steps_run"] :]) / max(1, sum(measured))
        )
        assert private["privacy"]["steps"] == len(private["step_seconds"]) and private["privacy"]["unit"] == "sequence"
        assert public["peak_bytes"] >= public["rss_at_reset_bytes"] > 0
        trainable[row["mode"]] = private["trainable_parameters"]
        assert trainable[row["mode"]] == public["trainable_parameters"]
    assert 0 < trainable["lora"] < trainable["full"]

    def must_not_run(spec):
        raise AssertionError(f"--resume ran {spec['trainer']} {spec['mode']} again")

    assert trl_speed.main([*argv, "--resume"], run_arm_with=must_not_run) == saved


def test_non_private_dpo_arm_trains_on_pairs_of_t_tokens(tmp_path):
    out = str(tmp_path / "trl_speed.json")
    [row] = trl_speed.main(
        [*TINY, "--trainer", "dpo", "--modes", "lora", "--arms", "non-private", "--out", out],
        run_arm_with=trl_speed.run_arm,
    )  # check_row_lengths raises unless every row is T long
    run = row["arms"]["non-private"]["runs"][0]
    assert set(row["arms"]) == {"non-private"} and "time_ratio" not in row
    assert run["step_examples"] == [2] * len(run["step_seconds"])  # pairs, not rows (chosen + rejected)
    assert any(entry.get("num_tokens") == 2 * 2 * 16 for entry in run["log_history"])  # 2 pairs of 2 rows of 16


def test_dpo_fixed_batch_counts_pairs_in_every_arm_and_profiles_a_step(tmp_path):
    """--fixed-batch: every private step trains exactly B pairs, counted from the private [B, 2, T] collation (not as
    rows // 2, which halved them); the plain-loss DPO reference trains B pairs a step; --profile adds a table."""
    out = str(tmp_path / "trl_speed.json")
    argv = [*TINY, "--trainer", "dpo", "--modes", "lora", "--arms", "private", "plain-loss", "--fixed-batch"]
    [row] = trl_speed.main([*argv, "--profile", "--out", out], run_arm_with=trl_speed.run_arm)
    private, plain = row["arms"]["private"]["runs"][0], row["arms"]["plain-loss"]["runs"][0]
    assert row["fixed_batch"] and row["plain_time_ratio"] > 0 and row["plain_cpu_time_ratio"] > 0
    for run in (private, plain):
        assert run["step_examples"] == [2] * len(run["step_seconds"]) and run["cpu_s_per_example"] > 0
        assert "aten::" in run["profile"]
    assert private["privacy"]["unit"] == "preference pair"
