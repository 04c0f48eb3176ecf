"""The end of a recipe run that succeeded: leave the process group (under `accelerate launch`) and exit 0."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch


def _leave_process_group() -> None:
    """Every rank leaves the process group together, while the interpreter is whole."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def exit_after_success() -> NoReturn:
    """Exit 0 once the run's work is done and written, without the interpreter's native teardown.

    A complete run was now and then aborted at that teardown ("terminate called without an active exception", exit
    code -6, on rank 1 of a two-process DPO run in CI, after both ranks had written identical results): a native
    thread pool (Arrow's under `datasets`, or a collective's) destroyed while one of its threads still ran. Leaving
    the process group first did not stop it. So Python's exit handlers run as usual (logging's, and any a callback
    registered, e.g. a tracker's), the streams are flushed, and the process ends there. Only a run that returned
    gets here: an exception still ends the process with its traceback and a non-zero status."""
    _leave_process_group()
    atexit._run_exitfuncs()  # what interpreter exit would run first; `os._exit` skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
