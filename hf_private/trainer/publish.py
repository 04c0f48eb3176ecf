"""Trainer's save, load, push and card hooks for a private run (`ReleaseHooks`), and the allow-listed upload.

What leaves the machine is decided here, in Trainer's own hooks: saves write only what was trained (an adapter of
the trained tensors where the model has no PEFT adapter), the ledger, the DP config and the card; pushes (Trainer's
two push paths, transformers 5.x) upload only `hf_private.release.artifacts.PUSHABLE_NAMES`, where Trainer would
upload the whole output directory (trainer_state.json, metrics and event files would go public), and a checkpoint
push sends the checkpoint's own weights, ledger and card together, never a checkpoint folder.
"""

from __future__ import annotations

import glob
from concurrent.futures import Future
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from huggingface_hub import CommitInfo
from torch import nn
from transformers.trainer_utils import HubStrategy, SaveStrategy
from transformers.utils import PushInProgress, hf_api

from ..logs import get_logger
from ..release.adapters import adapter_format, has_private_adapter, load_adapter_weights, withhold_local_base_path
from ..release.artifacts import copy_pushable, has_trainer_weights, pushable_files, withheld_files
from ..release.card_facts import RunFacts, optimizer_name, reloaded_checkpoint, write_card
from ..release.checkpoints import save_private_checkpoint
from . import sharded

if TYPE_CHECKING:  # type checkers read the hooks as the Trainer methods they override
    from transformers import Trainer as _Trainer

    from ..evaluation.held_out import Evaluations
    from ..run.privacy_run import PrivacyRun
else:
    _Trainer = object

logger = get_logger(__name__)


class AllowListedUpload:
    """Uploads an output directory's pushable files; warns once about each file it withholds."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(
        self,
        repo_id: str,
        folder: str,
        *,
        commit_message: str | None,
        token: str | None,
        revision: str | None,
        run_as_future: Literal[True, False],
    ) -> CommitInfo | Future[CommitInfo]:
        """`run_as_future` is a bool, spelled as its two values: `upload_folder` is typed once for each."""
        files = pushable_files(folder)
        new = [name for name in withheld_files(folder) if name not in self._warned]
        if new:
            logger.warning(
                "Not pushing %s from %s: only released artefacts leave the machine (see "
                "hf_private.release.artifacts.PUSHABLE_NAMES).",
                ", ".join(new),
                folder,
            )
            self._warned.update(new)
        logger.info("Pushing %s to %s.", ", ".join(files), repo_id)
        return hf_api().upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            token=token,
            revision=revision,
            run_as_future=run_as_future,
            allow_patterns=[glob.escape(name) for name in files],
        )


class ReleaseHooks(_Trainer):
    """Trainer's save, load, push and card methods for a private trainer: placed after `PrivateTrainingMixin` in the
    MRO (the mixin inherits it), so `super()` is the Trainer class. Reads the mixin's `privacy_run` and
    `_evaluations`."""

    privacy_run: PrivacyRun
    _evaluations: Evaluations
    model: nn.Module  # never None: the mixin refuses a missing model and model_init before Trainer is built
    # Trainer leaves these two unannotated, set to None in __init__: type checkers infer `None` from that.
    hub_model_id: str | None  # type: ignore[assignment]  # the repository's id once init_hf_repo has run
    push_in_progress: PushInProgress | None  # type: ignore[assignment]  # the checkpoint pushes under way
    fsdp2_sharded: bool  # the mixin's: FSDP2 shards the model (hf_private.trainer.sharded)

    @property
    def _output_dir(self) -> str:
        """`args.output_dir`, never None: TrainingArguments replaces None by 'trainer_output' when it is built."""
        output_dir = self.args.output_dir
        assert output_dir is not None, "TrainingArguments.__post_init__ sets output_dir"
        return output_dir

    @property
    def _hub_repo(self) -> str:
        """The repository pushes go to: Trainer's `init_hf_repo` names it, at build time when push_to_hub is set, and
        in `push_to_hub` before the push otherwise."""
        assert self.hub_model_id is not None, "init_hf_repo sets hub_model_id before any push"
        return self.hub_model_id

    @cached_property
    def _upload_to_hub(self) -> AllowListedUpload:
        """The one upload of this trainer's pushes: it warns once about each file it withholds."""
        return AllowListedUpload()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.fsdp2_sharded:  # full weights whatever the plugin's state_dict_type; Trainer asks Accelerate's state
            self._save(output_dir, state_dict=sharded.full_state_dict(self.model))  # gathered on every process
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        else:
            super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self._output_dir
        if self.args.should_save:
            self.privacy_run.save(output_dir)
            self._write_card(output_dir)

    @property
    def adapter_format(self) -> str:
        """How save_model stores the result: 'peft', 'private_adapter' (only the trained tensors) or 'full'."""
        return adapter_format(self.model, self.privacy_run.trained_parameter_names)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Checkpoints and final saves alike write only what was trained (see `hf_private.release.adapters`)."""
        output_dir = output_dir if output_dir is not None else self._output_dir
        if self.adapter_format != "private_adapter":
            super()._save(output_dir, state_dict)
            if self.args.should_save:
                withhold_local_base_path(output_dir)
        elif self.args.should_save:
            save_private_checkpoint(
                self.model, output_dir, self.privacy_run.trained_parameter_names, self.processing_class, self.args
            )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with sharded.checkpoint_io(self) if self.fsdp2_sharded else nullcontext():
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with sharded.checkpoint_io(self) if self.fsdp2_sharded else nullcontext():
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.fsdp2_sharded:  # Trainer loads the shards (or the full state) with Accelerate's FSDP loaders
            sharded.check_resumable(resume_from_checkpoint, self.args.world_size, self.accelerator.state.fsdp_plugin)
            with sharded.checkpoint_io(self):
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if has_private_adapter(resume_from_checkpoint):
            logger.info("Loading the private adapter from %s.", resume_from_checkpoint)
            load_adapter_weights(model if model is not None else self.model, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best and has_private_adapter(best):
            logger.info("Loading the best private adapter from %s (score: %s).", best, self.state.best_metric)
            load_adapter_weights(self.model, best)
        else:
            super()._load_best_model()
            if not best or not has_trainer_weights(best):
                return  # Trainer only warned that it could not find them: the weights are still the last step's
        self._reloaded_best = reloaded_checkpoint(
            self.state, self.args.metric_for_best_model, self._evaluations.results
        )

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ):
        """`Trainer.push_to_hub`: save, write the card, then upload only the output directory's allow-listed files
        (Trainer would upload the whole directory)."""
        args = self.args
        self.callback_handler.on_push_begin(args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None and args.should_save:
            model_name = Path(self._output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]
        token = token if token is not None else args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        model_tags = getattr(self.model, "model_tags", None)
        if model_tags is not None:
            tags = kwargs.get("tags") or []
            tags = [tags] if isinstance(tags, str) else list(tags)
            kwargs["tags"] = tags + [tag for tag in model_tags if tag not in tags]
        self.create_model_card(model_name=model_name, **kwargs)
        self._finish_current_push()
        return self._upload_to_hub(
            self._hub_repo,
            self._output_dir,
            commit_message=commit_message,
            token=token,
            revision=revision if revision is not None else args.hub_revision,
            run_as_future=not blocking,
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`Trainer._push_from_checkpoint`, but never a checkpoint folder: the checkpoint's allow-listed files,
        copied to the output directory together (weights, ledger and card of the same step), then uploaded from
        there in the background."""
        args = self.args
        running = self.push_in_progress  # the previous push, while its uploads are not all done
        running = None if running is None or running.is_done() else running
        if (
            not self.is_world_process_zero()
            or args.hub_strategy == HubStrategy.END
            or (running is not None and not args.hub_always_push)
        ):
            return
        self.callback_handler.on_push_begin(args, self.state, self.control)
        copy_pushable(checkpoint_folder, self._output_dir)
        progress = (
            f"step {self.state.global_step}"
            if args.save_strategy == SaveStrategy.STEPS
            else f"epoch {int(self.state.epoch)}"
        )
        job = self._upload_to_hub(
            self._hub_repo,
            self._output_dir,
            commit_message=f"Training in progress, {progress}",
            token=args.hub_token,
            revision=args.hub_revision,
            run_as_future=True,
        )
        # transformers types PushInProgress's jobs as one Future; they are a list of them, as its own Trainer passes
        if running is not None:
            running.jobs.append(job)  # type: ignore[union-attr]
        else:
            self.push_in_progress = PushInProgress([job])  # type: ignore[arg-type]

    def create_model_card(
        self,
        language=None,
        license=None,
        tags=None,
        model_name=None,
        finetuned_from=None,
        tasks=None,
        dataset_tags=None,
        dataset=None,
        dataset_args=None,
    ) -> None:
        if self.is_world_process_zero():
            self._write_card(
                self._output_dir,
                model_name=model_name,
                finetuned_from=finetuned_from,
                tags=[tags] if isinstance(tags, str) else tags,
                dataset=dataset,
                license=license,
                dataset_tags=[dataset_tags] if isinstance(dataset_tags, str) else dataset_tags,
            )

    def _write_card(self, output_dir: str, **publication: Any) -> None:
        """README.md, built by `release.card_facts` from what this run knows (the keywords: create_model_card's)."""
        run = self.privacy_run
        trained = run.trained_parameter_names
        write_card(
            output_dir,
            RunFacts(
                report=run.privacy_report(),
                audit=run.audit,
                model=run.model,
                adapter_format=self.adapter_format,
                trained_tensors=len(trained),
                trained_fraction=run.share_of_model(trained),
                citations=run.method.citations(),
                hub_id=self.args.hub_model_id or getattr(self, "hub_model_id", None),
                planned_steps=run.planned_steps,
                expected_batch_size=run.expected_batch_size,
                learning_rate=self.args.learning_rate,
                optimizer=optimizer_name(self.optimizer),
                evaluations=self._evaluations.results,
                reloaded_best=getattr(self, "_reloaded_best", None),
                global_step=self.state.global_step,
                processes=self.args.world_size,
                sharded=self.fsdp2_sharded,
            ),
            **publication,
        )
