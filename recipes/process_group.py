"""Leaving the process group at the end of a multi-process run (`accelerate launch`)."""

from __future__ import annotations

import torch


def leave_process_group() -> None:
    """Every rank leaves the process group together before the interpreter exits. Left to interpreter teardown, a
    rank was now and then aborted after its work was done ("terminate called without an active exception", exit code
    -6): a collective's thread destroyed while still running (seen in DPO runs of recipes/sft.py)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
