"""What sharding saves (issue 49): each of two FSDP2 processes holds about half of one process's parameters and
optimizer state, measured on a 58M-parameter Llama trained one AdamW step through `PrivateTrainer`
(`benchmarks.sharding`, the benchmark's own launches at a small batch: two gloo processes against one)."""

from __future__ import annotations

import pytest

from benchmarks import sharding

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def rows():
    size = dict(seq_len=16, batch=4, accumulation=1, warmup=0, steps=1, dataset_size=64)
    return {
        layout: sharding.run_layout({**sharding.MODEL, "layout": layout, **size}, timeout_s=900)
        for layout in ("one", "fsdp2")
    }


def _state(rank: dict) -> int:
    return rank["parameter_bytes"] + rank["optimizer_bytes"]


def test_each_process_holds_half_the_parameters_and_optimizer_state(rows):
    (one,) = rows["one"]["ranks"]
    sharded = rows["fsdp2"]["ranks"]
    assert rows["one"]["parameters"] >= 50_000_000
    assert len(sharded) == 2
    # AdamW's two moments exist (the step ran) and are counted: twice the float32 parameters
    assert one["optimizer_bytes"] >= 2 * one["parameter_bytes"]
    for rank in sharded:
        share = _state(rank) / _state(one)
        # FSDP2 pads each shard to ⌈rows / 2⌉ rows: at most a row a tensor over half
        assert 0.5 <= share <= 0.51, f"rank {rank['rank']} holds {share:.3f} of one process's state"
    assert sum(_state(rank) for rank in sharded) <= 1.01 * _state(one)


def test_both_runs_trained_and_spent_the_same_budget(rows):
    assert rows["one"]["examples"] == rows["fsdp2"]["examples"] > 0  # the same Poisson draws under the test seed
    epsilons = {rank["epsilon"] for row in rows.values() for rank in row["ranks"]}
    assert len(epsilons) == 1 and epsilons.pop() > 0
