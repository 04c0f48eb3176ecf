"""What `PrivateTrainer` writes into a save or checkpoint, and reads back to resume.

A save holds the weights in the smallest faithful format (`hf_private.release.adapters`), the method config and the
privacy ledger; resuming needs that ledger, so the privacy already spent carries over into the new run's ε.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..data.user_cap import FINGERPRINT
from ..privacy import PrivacyLedger
from .adapters import save_private_adapter
from .artifacts import DP_CONFIG_NAME, LEDGER_NAME, METHOD_STATE_NAME, TRAINING_ARGS_NAME, USER_CAP_NAME

_CHECKPOINT_NAME = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def resolve_checkpoint(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """Trainer's `resume_from_checkpoint`: a checkpoint folder, or True for the newest one in `output_dir`."""
    checkpoint = get_last_checkpoint(output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    if not checkpoint:
        raise ValueError(f"No checkpoint found in {output_dir} to resume from.")
    return checkpoint


def save_private_checkpoint(
    model: nn.Module, output_dir: str, trained_names: Iterable[str], processing_class, args
) -> None:
    """What Trainer's `_save` writes, with the private adapter of the trained tensors in place of the full model."""
    save_private_adapter(model, output_dir, trained_names)
    if processing_class is not None:
        processing_class.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def save_privacy_record(output_dir: str, ledger: PrivacyLedger, dp_config, method_state: dict[str, Any]) -> None:
    """The ledger, the method config and the method's state (if any), next to the weights they describe."""
    ledger.save(os.path.join(output_dir, LEDGER_NAME))
    dp_config.save_pretrained(output_dir)
    if method_state:
        with open(os.path.join(output_dir, METHOD_STATE_NAME), "w") as f:
            json.dump(method_state, f, indent=2, sort_keys=True)


def save_user_cap(output_dir: str, record: dict[str, list[str]], config: Any) -> None:
    """ELS: which examples every user kept, by content (`user_cap.UserExamples.record`), so a resumed run keeps the
    very same ones whatever the order of its rows."""
    with open(os.path.join(output_dir, USER_CAP_NAME), "w") as f:
        json.dump(
            {
                "user_column": config.user_column,
                "max_examples_per_user": config.max_examples_per_user,
                "fingerprint": FINGERPRINT,
                "users": record,
            },
            f,
        )


def load_user_cap(checkpoint: str, config: Any) -> dict[str, list[str]]:
    """The examples an ELS run kept, per user by content, from its checkpoint; refused when missing, drawn under
    another cap, or naming the examples by row number (an earlier version's: rows in another order are others)."""
    path = os.path.join(checkpoint, USER_CAP_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{checkpoint} has no {USER_CAP_NAME}: an example-level-sampled (ELS) user-level run must keep the "
            "examples it drew for every user, or a resumed run could draw others and let a user contribute more "
            "than max_examples_per_user. Resume from a checkpoint written by this version, or start afresh."
        )
    with open(path) as f:
        record = json.load(f)
    if record.get("fingerprint") != FINGERPRINT:
        raise ValueError(
            f"{path} names the kept examples by row number (an earlier version) or by another "
            "fingerprint: in a training set whose rows come in another order those numbers are other "
            "examples, and a user could keep more than max_examples_per_user. Start afresh in a new "
            "output_dir."
        )
    if (record["user_column"], record["max_examples_per_user"]) != (config.user_column, config.max_examples_per_user):
        raise ValueError(
            f"{path} was drawn for user_column={record['user_column']!r}, max_examples_per_user="
            f"{record['max_examples_per_user']}; this run has {config.user_column!r}, "
            f"{config.max_examples_per_user}. Resume with the same settings."
        )
    return record["users"]


def load_method_state(checkpoint: str) -> dict[str, Any]:
    """The method state saved with a checkpoint (`DPMethod.state_dict`); empty when the method keeps none."""
    path = os.path.join(checkpoint, METHOD_STATE_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def checkpoint_step(checkpoint: str) -> int | None:
    """The global step in a Trainer checkpoint folder's name (`checkpoint-<step>`); None for another name."""
    match = _CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(checkpoint)))
    return int(match.group(1)) if match else None


def load_dp_config_dict(checkpoint: str) -> dict[str, Any] | None:
    """The method config saved with a checkpoint, as written (`MethodConfig.to_dict`); None when it has none."""
    path = os.path.join(checkpoint, DP_CONFIG_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_ledger(checkpoint: str, dataset_size: int, delta: float, accountant: str) -> PrivacyLedger:
    """The ledger a resumed run continues; refused when missing or when it accounts for another dataset or δ."""
    path = os.path.join(checkpoint, LEDGER_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{checkpoint} has no {LEDGER_NAME}: resuming from it would lose the privacy already spent. "
            "Resume only from checkpoints written by PrivateTrainer."
        )
    ledger = PrivacyLedger.load(path)
    if (ledger.dataset_size, ledger.delta, ledger.accountant) != (dataset_size, delta, accountant):
        raise ValueError(
            f"Checkpoint ledger (N={ledger.dataset_size}, δ={ledger.delta}, {ledger.accountant}) does not match "
            f"this run (N={dataset_size}, δ={delta}, {accountant})."
        )
    return ledger
