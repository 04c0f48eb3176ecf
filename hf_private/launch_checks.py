"""Say so when a launch ends with fewer processes than asked.

`accelerate launch --cpu --num_processes 2` (and `--num_processes 2` without `--multi_gpu` on a machine without
several GPUs) uses accelerate's simple launcher, which starts ONE process: the run trains, just not as the user
asked, and nothing says so. The requested count is not passed on, but the launch leaves traces in the environment:
launchers that start several processes give each its world size (WORLD_SIZE, or MPI's variables), and the simple
launcher sets MASTER_ADDR only when asked for more than one process.
"""

from __future__ import annotations

import os

from .logs import get_logger

logger = get_logger(__name__)

# Where launchers put the number of processes: torchrun and accelerate's multi-GPU launcher, then MPI (the variables
# accelerate reads for a multi-CPU run).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# Set by every `accelerate launch` (simple, multi-GPU, ...) in the processes it starts.
_ACCELERATE_LAUNCH_VARIABLE = "ACCELERATE_MIXED_PRECISION"

_FIX = ("Start several processes with `accelerate launch --multi_gpu --num_processes N` (on CPU with use_cpu=True, "
        "`--use_cpu true` in the recipe, or ACCELERATE_USE_CPU=1): `--cpu` always starts a single process, and "
        "accelerate refuses it together with --multi_gpu.")


def check_process_count(world_size: int) -> None:
    """Warn when this run has fewer processes than its launcher was asked for."""
    sizes = [int(value) for name in _WORLD_SIZE_VARIABLES if (value := os.environ.get(name, "").strip()).isdigit()]
    if sizes:
        if world_size >= sizes[0]:
            return
        asked = f"{sizes[0]} processes"
    elif world_size == 1 and _ACCELERATE_LAUNCH_VARIABLE in os.environ and os.environ.get("MASTER_ADDR"):
        asked = "more than one process (accelerate launch set MASTER_ADDR, which it does only for --num_processes > 1)"
    else:
        return
    logger.warning(
        "The launch asked for %s, but this run has %d: the logical batch (per_device_train_batch_size × "
        "gradient_accumulation_steps × processes) is smaller than planned. %s", asked, world_size, _FIX,
    )
