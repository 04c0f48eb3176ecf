"""What the recipes share: a method's name from its flag, and its logical batch split over processes and
accumulation steps.

The paper defaults themselves are declared by each method (`DPMethod.recipe_defaults`, in its folder). The expected
batch size B is the paper's logical batch: q = B/N. The recipe splits it into physical chunks of at most
`--per_device_train_batch_size` with gradient accumulation, so B does not depend on the hardware.
"""

from __future__ import annotations

import math

from hf_private.methods import registered_methods


def method_name(flag: str) -> str:
    """The registered name a `--method` flag means; short names work too (frost is dp-frost, sparse_lowrank
    sparse-lowrank, dpfp dp-fp, lora dp-lora). An unknown flag comes back as it is, for the caller to refuse."""
    wanted = flag.replace("_", "").replace("-", "").lower()
    for name in registered_methods():
        if wanted in (name.replace("-", ""), name.replace("-", "").removeprefix("dp")):
            return name
    return flag


def split_batch(expected_batch_size: int, max_physical: int, world_size: int) -> tuple[int, int]:
    """(physical batch per process, gradient accumulation steps) whose product with world_size is the expected batch.

    Takes the fewest accumulation steps that keep chunks within `max_physical`, preferring an exact split (up to
    twice as many steps); otherwise the nearest, which the caller reports.
    """
    if expected_batch_size < world_size:
        raise ValueError(f"Expected batch {expected_batch_size} is smaller than the {world_size} processes.")
    steps = max(1, math.ceil(expected_batch_size / (max_physical * world_size)))
    for candidate in range(steps, 2 * steps + 1):
        if expected_batch_size % (candidate * world_size) == 0:
            return expected_batch_size // (candidate * world_size), candidate
    return max(1, round(expected_batch_size / (steps * world_size))), steps
