"""hf_private's loggers live under transformers' library logger, as `transformers.hf_private.<module>`.

So the messages follow whatever a Trainer script already does with logging: `transformers.logging.set_verbosity_*`,
`TrainingArguments.log_level` (main process) and `log_level_replica` (the others) control them, and transformers'
handler prints them without any `logging.basicConfig`. What a user must act on (a setting overridden, noise so
large the model learns little, the budget reached) is logged at WARNING, visible at transformers' default
verbosity; the plan and the final ε at INFO (scripts that show Trainer's own progress lines show these too, and the
final ε is also among the metrics every Trainer run prints).
"""

from __future__ import annotations

import logging

from transformers.utils import logging as transformers_logging

ROOT = "transformers.hf_private"


def get_logger(module: str) -> logging.Logger:
    """The logger for an hf_private module (`__name__`), e.g. `transformers.hf_private.trainer`."""
    transformers_logging.get_logger()  # make sure transformers' handler and default level are installed
    return logging.getLogger(f"transformers.{module}")
