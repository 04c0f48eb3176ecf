"""Forks: a run resumed from a checkpoint older than the newest one its output directory holds.

Each line of training from the same data is a release. Resuming from checkpoint-2 while checkpoint-4 exists starts a
second line: whatever was published from the first one after step 2 (`hub_strategy="every_save"` pushes every
checkpoint) stays public, and its privacy loss composes with this run's. Nothing in either ledger shows that on its
own, so the resumed run records the fork: the checkpoint it resumed, the newer one it found, and the releases that
line made after the common start. The report composes them into `epsilon_with_forks` and the card says why.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from ..privacy import MechanismGroup, PrivacyLedger
from ..release.artifacts import LEDGER_NAME
from ..release.checkpoints import checkpoint_step


def find_fork(output_dir: str, checkpoint: str, resumed: PrivacyLedger) -> dict[str, Any] | None:
    """The fork made by resuming `checkpoint` (whose ledger is `resumed`), or None when no newer checkpoint exists.

    The newer line's releases are those of the newest checkpoint's ledger after `resumed`'s, when `resumed` is its
    prefix; otherwise (another run's checkpoint in the same folder) all of them, which can only over-count.
    """
    newest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if newest is None or os.path.realpath(newest) == os.path.realpath(checkpoint):
        return None
    resumed_step, newest_step = checkpoint_step(checkpoint), checkpoint_step(newest)
    if newest_step is None or (resumed_step is not None and newest_step <= resumed_step):
        return None
    path = os.path.join(newest, LEDGER_NAME)
    later = PrivacyLedger.load(path).mechanisms if os.path.isfile(path) else []
    return {
        "resumed_from": os.path.basename(os.path.normpath(checkpoint)),
        "newer_checkpoint": os.path.basename(newest),
        "newer_releases": [group.to_dict() for group in releases_after(later, resumed.mechanisms)],
        "newer_ledger_found": os.path.isfile(path),
    }


def releases_after(mechanisms: list[MechanismGroup], prefix: list[MechanismGroup]) -> list[MechanismGroup]:
    """`mechanisms` without the releases of `prefix`, when `prefix` starts them; all of `mechanisms` otherwise."""
    remaining = list(mechanisms)
    for group in prefix:
        if not remaining or not remaining[0].same_mechanism(group) or remaining[0].steps < group.steps:
            return list(mechanisms)
        left = remaining[0].steps - group.steps
        remaining = ([replace(remaining[0], steps=left)] if left else []) + remaining[1:]
    return remaining
