"""Pushes to the Hub: Trainer's two push paths (transformers 5.x), uploading only the allow-listed artefacts.

Trainer uploads the whole output directory: trainer_state.json, metrics and event files would go public. Here the
final push and the checkpoint pushes send only `hf_private.release.artifacts.PUSHABLE_NAMES`, and a checkpoint push
sends
the checkpoint's own weights, ledger and card together, never a checkpoint folder.
"""

from __future__ import annotations

import glob
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import CommitInfo
from transformers.trainer_utils import HubStrategy, SaveStrategy
from transformers.utils import PushInProgress, hf_api

from ..logs import get_logger
from ..release.artifacts import copy_pushable, pushable_files, withheld_files

if TYPE_CHECKING:
    from .mixin import PrivateTrainer

logger = get_logger(__name__)


class AllowListedUpload:
    """Uploads an output directory's pushable files; warns once about each file it withholds."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, repo_id: str, folder: str, *, commit_message: str | None, token: str | None,
                 revision: str | None, run_as_future: bool) -> CommitInfo | Future[CommitInfo]:
        files = pushable_files(folder)
        new = [name for name in withheld_files(folder) if name not in self._warned]
        if new:
            logger.warning("Not pushing %s from %s: only released artefacts leave the machine (see "
                           "hf_private.release.artifacts.PUSHABLE_NAMES).", ", ".join(new), folder)
            self._warned.update(new)
        logger.info("Pushing %s to %s.", ", ".join(files), repo_id)
        return hf_api().upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message, token=token, revision=revision,
            run_as_future=run_as_future, allow_patterns=[glob.escape(name) for name in files],
        )


def push_release(trainer: PrivateTrainer, upload: AllowListedUpload, commit_message: str | None, blocking: bool,
                 token: str | None, revision: str | None, private: bool | None, **kwargs: Any):
    """`Trainer.push_to_hub`: save, write the card, then upload the output directory's allow-listed files."""
    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    model_name = kwargs.pop("model_name", None)
    if model_name is None and args.should_save:
        model_name = Path(args.output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]
    token = token if token is not None else args.hub_token
    if trainer.hub_model_id is None:
        trainer.init_hf_repo(token=token, private=private)
    trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    model_tags = getattr(trainer.model, "model_tags", None)
    if model_tags is not None:
        tags = kwargs.get("tags") or []
        tags = [tags] if isinstance(tags, str) else list(tags)
        kwargs["tags"] = tags + [tag for tag in model_tags if tag not in tags]
    trainer.create_model_card(model_name=model_name, **kwargs)
    trainer._finish_current_push()
    return upload(
        trainer.hub_model_id, args.output_dir, commit_message=commit_message, token=token,
        revision=revision if revision is not None else args.hub_revision, run_as_future=not blocking,
    )


def push_checkpoint(trainer: PrivateTrainer, upload: AllowListedUpload, checkpoint_folder: str) -> None:
    """`Trainer._push_from_checkpoint`: the checkpoint's allow-listed files, copied to the output directory together
    (weights, ledger and card of the same step), then uploaded from there in the background."""
    args = trainer.args
    busy = trainer.push_in_progress is not None and not trainer.push_in_progress.is_done()
    if (not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END
            or (busy and not args.hub_always_push)):
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    copy_pushable(checkpoint_folder, args.output_dir)
    progress = (f"step {trainer.state.global_step}" if args.save_strategy == SaveStrategy.STEPS
                else f"epoch {int(trainer.state.epoch)}")
    job = upload(trainer.hub_model_id, args.output_dir, commit_message=f"Training in progress, {progress}",
                 token=args.hub_token, revision=args.hub_revision, run_as_future=True)
    if busy:
        trainer.push_in_progress.jobs.append(job)
    else:
        trainer.push_in_progress = PushInProgress([job])
