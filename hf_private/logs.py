"""hf_private's loggers live under transformers' library logger, as `transformers.hf_private.<module>`.

So the messages follow whatever a Trainer script already does with logging: `transformers.logging.set_verbosity_*`,
`TrainingArguments.log_level` (main process) and `log_level_replica` (the others) control them, and transformers'
handler prints them without any `logging.basicConfig`. What a user must act on (a setting overridden, noise so
large the model learns little, a clip norm far above the gradient norms, the budget reached) is logged at WARNING,
visible at transformers' default verbosity, and so is the training plan, once: it is the one line a DP user must read.
The final ε is INFO (scripts that show Trainer's own progress lines show it too, and it is among the metrics every
Trainer run prints).

In a multi-process run every rank executes the same checks, so every warning would print once per process: the other
ranks keep only errors (`MainProcessOnly`), and the main process speaks for the run.
"""

from __future__ import annotations

import logging
import os

from transformers.utils import logging as transformers_logging

ROOT = "transformers.hf_private"
# Where launchers put the global rank: torchrun and accelerate's multi-GPU launcher (RANK), MPI (accelerate's
# mpirun launcher reads the same three).
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


def process_rank() -> int:
    """This process's global rank as its launcher set it (0 when not launched as one of several)."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


class MainProcessOnly(logging.Filter):
    """Drops records below ERROR on ranks other than 0: each rank would repeat the main process's warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or process_rank() == 0


_MAIN_PROCESS_ONLY = MainProcessOnly()


def get_logger(module: str) -> logging.Logger:
    """The logger for an hf_private module (`__name__`), e.g. `transformers.hf_private.trainer`."""
    transformers_logging.get_logger()  # make sure transformers' handler and default level are installed
    logger = logging.getLogger(f"transformers.{module}")
    logger.addFilter(_MAIN_PROCESS_ONLY)  # a logger's filter sees only its own records, so each module's gets it
    return logger
