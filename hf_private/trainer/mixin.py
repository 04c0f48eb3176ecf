"""`privatize(TrainerClass)`: any `transformers.Trainer` subclass, made differentially private; `PrivateTrainer` is
`Trainer` made so.

Trainer glue only: Poisson batch sampler → physical chunks → engine hooks clip per example during the one backward
pass → the noisy optimizer adds noise once per logical batch → the ledger records the step. Every privacy decision is
the run's (`run.privacy_run.PrivacyRun`); the model stays the user's own `PreTrainedModel`/`PeftModel`, so saving,
evaluation and `push_to_hub` work as usual.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from accelerate.utils.memory import clear_device_cache
from torch import nn
from torch.utils.data import DataLoader, Sampler, Subset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput

from ..data.labels import log_ignored_labels
from ..data.packing import (
    PACKED_FORWARD_TOKENS,
    check_packing_tokens,
    lay_out_rows,
    packed_examples,
    packed_layout,
    packed_pieces,
    packed_shape,
    packs,
    slice_packed,
)
from ..data.sampling import EmptySafeCollator, PoissonBatchSampler, batch_size_of, chunk_lengths, slice_examples
from ..data.users import (
    UNIT_SIZES_KEY,
    UnitCollator,
    UnitTagged,
    UserIndex,
    UserPoissonSampler,
    expected_examples,
    run_lengths,
    unit_slices,
)
from ..engine import PerExampleGradientEngine
from ..engine.independence import PROBE_EXAMPLES, probe_example_independence, spread_by_length
from ..evaluation.held_out import Evaluations, TrainingRows, pad_token_id
from ..integrations.losses import PerExampleLoss, check_per_example_losses
from ..logs import get_logger
from ..methods import MethodConfig
from ..models.head_choice import warn_if_cls_head_on_mean_encoder
from ..models.support import is_causal_lm
from ..optimizer import noisy_optimizer
from ..privacy.rng import SecretRandom
from ..release.adapters import adapter_format, has_private_adapter, load_adapter_weights, withhold_local_base_path
from ..release.artifacts import has_trainer_weights
from ..release.card_facts import RunFacts, optimizer_name, reloaded_checkpoint, write_card
from ..release.checkpoints import resolve_checkpoint, save_private_checkpoint
from ..run.privacy_run import PrivacyRun
from .preflight import (
    check_before_trainer,
    check_built_trainer,
    check_private_path_unchanged,
    private_path_functions,
)
from .publish import AllowListedUpload, push_checkpoint, push_release

logger = get_logger(__name__)


class _FromRun:
    """A trainer attribute that is the privacy run's own (`trainer.privacy_run`), under the trainer's public name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.privacy_run, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.privacy_run, self.name, value)


class PrivateTrainingMixin:
    """Placed first in the MRO by `privatize`: a Trainer (sub)class plus `dp_config`; every other keyword is the
    class's own."""

    # The run's state and actions under the trainer's public names: `trainer.plan` is `trainer.privacy_run.plan`.
    (plan, ledger, engine, stage, delta, expected_batch_size, sample_rate, steps_per_epoch, planned_steps,
     noise_multiplier, mechanism_name, has_formal_guarantee, training_steps, trained_parameter_names, record_release,
     suspend_training_engine, privacy_report, attach_audit, audit) = (_FromRun() for _ in range(19))

    def __init__(self, *trainer_args: Any, dp_config: MethodConfig, per_example_loss: PerExampleLoss | None = None,
                 packed_row_tokens: int | str | None = "auto",
                 packed_forward_tokens: int | None = PACKED_FORWARD_TOKENS, **trainer_kwargs: Any) -> None:
        names = _positional_names(type(self))  # DPOTrainer's second positional parameter is ref_model
        given = {**dict(zip(names, trainer_args)), **trainer_kwargs}
        model, args = given.get("model"), given.get("args")
        # before Trainer, which creates the Hub repo when push_to_hub is set (see preflight)
        checked = check_before_trainer(type(self), PrivateTrainingMixin, model, args, dp_config, per_example_loss,
                                       given.get("train_dataset"),
                                       {k: v for k, v in given.items() if k not in ("model", "args")})
        # packed chunks: rows of whole examples, several to a forward (hf_private.data.packing)
        self.packed_row_tokens, self.packed_forward_tokens = check_packing_tokens(packed_row_tokens,
                                                                                  packed_forward_tokens)
        self.dp_method = dp_config.build_method()
        warn_if_cls_head_on_mean_encoder(model)
        self.dataset_size = checked.dataset_size
        model = self.dp_method.wrap_model(model)  # after every check: a refused run leaves the model as it was
        self.dp_method.prepare_model(model)
        if "model" in names[:len(trainer_args)]:
            trainer_args = tuple(model if name == "model" else value for name, value in zip(names, trainer_args)
                                 ) + trainer_args[len(names):]
        else:
            trainer_kwargs["model"] = model
        super().__init__(*trainer_args, **trainer_kwargs)
        self._upload_to_hub = AllowListedUpload()
        self.dp_config = dp_config
        expected = check_built_trainer(self, args is not None, dp_config, per_example_loss, checked)
        # what the private path's methods resolve to, compared again before training and before every step
        self._private_path = private_path_functions(self, per_example_loss is not None)
        self.trainer_family = checked.family  # the unit, its rows and loss (hf_private.integrations)
        self.train_dataset = checked.family.training_set(self.train_dataset, self.args)
        # At user level, the users of the training set as the trainer holds it: read again only if the trainer
        # prepared a new dataset (TRL tokenizes, and may drop rows)
        self.user_index = checked.users
        if self.user_index is not None and self.train_dataset is not given.get("train_dataset"):
            self.user_index = UserIndex.of(self.train_dataset, dp_config.user_column)
        self._uls = self.user_index is not None and dp_config.user_sampling == "user"
        self.per_example_loss = per_example_loss or checked.family.per_unit_loss(self.args)
        self.custom_per_example_loss = per_example_loss is not None  # packed chunks need the family's own loss
        self.privacy_run = PrivacyRun(dp_config, self.dp_method, self.model, self, self.dataset_size, checked.delta,
                                      expected, getattr(self.train_dataset, "_fingerprint", None), checked.unit)
        # the logged loss is a mean per example: under ULS a sampled user brings up to k examples
        self._examples_per_batch = expected_examples(self.user_index, dp_config, self.sample_rate, expected)
        self.add_callback(_LogicalBatchBoundaries(self))
        self._set_signature_columns_if_needed()
        training_rows = TrainingRows(self.train_dataset, self._signature_columns,
                                     [*self.label_names, *checked.family.derived_columns],
                                     pad_token_id(self.processing_class), checked.family.unmarked_units(self.args))
        self._evaluations = Evaluations(training_rows, self.eval_dataset)
        self.privacy_run.log_plan(self.user_index)
        log_ignored_labels(checked.labels)

    # ------------------------------------------------------------------ data
    def training_data(self) -> tuple[Any, Callable]:
        """The training set as the model reads it (unused columns removed) and its empty-batch-safe collator; at user
        level each example tagged with its user, and each batch told how many examples each of its users has."""
        dataset = self.train_dataset
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        collate = EmptySafeCollator(self.trainer_family.training_collator(self.data_collator), dataset[0])
        if self.user_index is None:
            return dataset, collate
        if self._uls:
            return UnitTagged(dataset, self.user_index.user_of), UnitCollator(collate)
        # ELS: each user capped, the kept examples found by content on resume (hf_private.data.user_cap)
        kept = self.privacy_run.kept_by_users(self.user_index, self.train_dataset, self._from_main_process)
        return (dataset.select(kept) if hasattr(dataset, "select") else Subset(dataset, kept.tolist())), collate

    def _from_main_process(self, value: Any) -> Any:
        """`value` as the main process has it, on every process."""
        if self.args.world_size == 1:
            return value
        shared = [value]
        broadcast_object_list(shared, from_process=0)
        return shared[0]

    def get_train_dataloader(self) -> DataLoader:
        """A plain DataLoader with a Poisson batch sampler (not passed through Accelerate: it would re-shard)."""
        dataset, collate = self.training_data()
        lengths = None if self._uls else chunk_lengths(self.args, self.train_dataset, self.processing_class,
                                                       packed=len(dataset) >= 2 and packs(collate, dataset))
        sampler = self._poisson_sampler(dataset, self.sample_rate, self.steps_per_epoch,
                                        self.args.gradient_accumulation_steps,
                                        self.privacy_run.sampling_random("training sampling"), lengths)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                          num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)

    def poisson_chunks(self, dataset: Any, sample_rate: float, random: SecretRandom) -> list[list[int]]:
        """This process's share of one Poisson sample of units at `sample_rate` (a method's own release, e.g.
        DP-FROST's selection), as indices into `dataset` (`training_data()`'s) in physical chunks of at most
        per_device_train_batch_size units: users under ULS, each with all of its drawn examples."""
        indices = next(iter(self._poisson_sampler(dataset, sample_rate, 1, 1, random)))
        sizes = run_lengths(self.user_index.user_of[indices]) if self._uls else [1] * len(indices)
        return [indices[start:stop] for start, stop, _ in unit_slices(sizes, self.args.per_device_train_batch_size)]

    def _poisson_sampler(self, dataset: Any, sample_rate: float, steps: int, num_chunks: int, random: SecretRandom,
                         lengths: torch.Tensor | None = None) -> Sampler[list[int]]:
        """Poisson logical batches of the privacy unit: users under ULS (q over users), examples otherwise."""
        args = self.args
        if self._uls:
            return UserPoissonSampler(self.user_index, sample_rate, steps, self.dp_config.examples_per_user,
                                      num_chunks, rank=args.process_index, world_size=args.world_size, random=random)
        return PoissonBatchSampler(len(dataset), sample_rate, steps, num_chunks, rank=args.process_index,
                                   world_size=args.world_size, random=random, lengths=lengths)

    # ------------------------------------------------------------------ optimisation
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        noisy = noisy_optimizer(self.optimizer)  # Trainer may call again with it wrapped by Accelerate
        self.optimizer = noisy or self.privacy_run.noisy_optimizer(super().create_optimizer(model))
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            labels = inputs.get("labels")  # before Trainer's label smoother pops them
            if labels is None:  # nothing to count for the collapse warning (DPO: no labels)
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            self._evaluations.predictions.add(model, outputs, labels)
            return (loss, outputs) if return_outputs else loss
        loss, outputs = self.summed_loss(model, inputs)
        return (loss, outputs) if return_outputs else loss

    def summed_loss(self, model: nn.Module, inputs: dict) -> tuple[torch.Tensor, Any]:
        """Σ_u ℓ_u with the family's per-unit loss, in whatever mode the model is (the independence probe runs eval)."""
        losses, outputs = self.trainer_family.unit_losses(self, model, inputs)
        losses = check_per_example_losses(losses, batch_size_of(inputs))
        # A non-finite ℓ_b gets zero gradient through where(), and the engine zeroes whatever NaN still reaches its
        # terms; the logged loss must not become NaN exactly when that record is sampled either.
        return torch.where(torch.isfinite(losses), losses, 0.0).sum(), outputs

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward/backward in physical chunks of at most per_device_train_batch_size, each clipped per example."""
        self.privacy_run.start_next_stage()
        if not self.privacy_run.may_step():
            self._stop_for_budget()
            return torch.zeros((), device=self.args.device)
        self.privacy_run.prepare_noise()
        # The unwrapped model: DDP must not all-reduce un-clipped gradients (the optimizer reduces clipped sums).
        total = self.record_chunks(self.accelerator.unwrap_model(model), inputs, self.engine)
        return total / (self._examples_per_batch / self.args.world_size)

    def record_chunks(self, model: nn.Module, inputs: dict, engine: PerExampleGradientEngine) -> torch.Tensor:
        """Forward/backward `inputs` in chunks of at most per_device_train_batch_size units (examples; users at user
        level, each with all of its examples), a packed chunk laid out as rows of whole units of at most
        `packed_row_tokens` tokens, at most `packed_forward_tokens` padded tokens a forward (varlen kernels: a row a
        forward), each unit's terms into `engine`; the summed loss. The first chunk of
        ≥ 2 units of the run, and the first after every switch of the trainable set, is probed for unit independence,
        together with a probe chunk from the training set."""
        inputs = dict(inputs)
        unit_sizes = inputs.pop(UNIT_SIZES_KEY, None)
        size = batch_size_of(inputs)
        if unit_sizes is None:
            unit_sizes = [1] * size
        rows = self.trainer_family.rows_per_unit(model, inputs)  # rows of one example (DPO: 2)
        total = torch.zeros((), device=self.args.device)
        lengths, per_device = packed_examples(inputs), self.args.per_device_train_batch_size
        pieces = ((start, stop, units, None) for start, stop, units in unit_slices(unit_sizes, per_device))
        if lengths is not None:
            shape = packed_shape(model, self.packed_row_tokens, self.packed_forward_tokens)
            pieces = packed_pieces(unit_sizes, lengths, per_device, *shape)
        for start, stop, units, packed_rows in pieces:
            if packed_rows is not None:  # whole examples sliced by their tokens, laid out in rows
                part = lay_out_rows(slice_packed(inputs, start, stop), packed_rows, not is_causal_lm(model))
            else:
                part = {k: slice_examples(v, size, start, stop) for k, v in inputs.items()}
            unit_rows = rows if all(n == 1 for n in units) else [n * rows for n in units]
            with engine.recording(len(units), unit_rows, packed=packed_layout(part)):
                total = total + self._chunk_step(model, part)
            engine.finish_backward()
            if len(units) >= 2 and self.privacy_run.needs_independence_probe:
                self._probe_example_independence(model, part, units, rows, engine)
        return total

    def _chunk_step(self, model: nn.Module, inputs: dict) -> torch.Tensor:
        """One physical chunk's forward and backward as `Trainer.training_step` runs them (context parallelism's
        context, train mode, `_prepare_inputs`, autocast, `torch_empty_cache_steps`, `accelerator.backward`), with the
        loss of `_training_loss`: never through an overridable `compute_loss`, so what trains is what the probe tests.
        The summed loss is not rescaled for gradient accumulation (the optimizer divides the noisy sum by the expected
        batch), and no LOMO learning rate reaches backward (a fused update there would skip the clip and the noise);
        DataParallel and DeepSpeed are refused when the trainer is built."""
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with cp_context():
            model.train()
            if callable(getattr(self.optimizer, "train", None)):
                self.optimizer.train()
            loss = self._training_loss(model, self._prepare_inputs(inputs))
            every = self.args.torch_empty_cache_steps
            if every is not None and self.state.global_step % every == 0:
                clear_device_cache()
            self.accelerator.backward(loss)
        return loss.detach()

    def _training_loss(self, model: nn.Module, inputs: dict) -> torch.Tensor:
        """The one loss private training computes, which the independence probe recomputes: `summed_loss` (the
        family's per-unit loss or the user's per_example_loss, summed) under Trainer's autocast."""
        with self.compute_loss_context_manager():
            return self.summed_loss(model, inputs)[0]

    def _probe_example_independence(self, model: nn.Module, inputs: dict, units: list[int], rows: int,
                                    engine: PerExampleGradientEngine) -> None:
        """Units recomputed alone must get the norms they had in this chunk and in a chunk of training examples
        spread over their lengths, collated as training chunks are."""
        dataset, collate = self.training_data()
        indices = spread_by_length(dataset, count=min(PROBE_EXAMPLES, self.args.per_device_train_batch_size))
        if self._uls:  # a user's examples consecutive, as the sampler keeps them
            indices.sort(key=lambda i: self.user_index.user_of[i])
        probe = dict(collate([dataset[i] for i in indices]))
        probe_units = [int(n) for n in probe.pop(UNIT_SIZES_KEY, torch.ones(len(indices), dtype=torch.long))]
        probe = self._prepare_inputs(probe)
        low_precision = self.args.bf16 or any(p.dtype in (torch.float16, torch.bfloat16) for _, p in engine.parameters)
        probe_rows = self.trainer_family.rows_per_unit(model, probe)
        chunks = [(self._prepare_inputs(inputs), sum(units), rows, _grouped(units)),
                  (probe, len(indices), probe_rows, _grouped(probe_units))]
        probe_example_independence(engine, model, chunks, self._training_loss, low_precision)
        self.privacy_run.needs_independence_probe = False

    def _stop_for_budget(self) -> None:
        self.privacy_run.stop_for_budget()
        self.control.should_training_stop = True

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        check_private_path_unchanged(self, self._private_path)  # a patch after construction, before anything runs
        if resume_from_checkpoint:
            resume_from_checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
            self.privacy_run.resume(resume_from_checkpoint, self.args.output_dir)
        requested = self.args.max_steps if self.args.max_steps > 0 else self.planned_steps
        if not self.privacy_run.begin(requested, resumed=bool(resume_from_checkpoint)):
            # No step is possible: load the checkpoint's weights (what save/push will publish), train nothing.
            metrics = self.privacy_run.spent_already(resume_from_checkpoint)
            if resume_from_checkpoint:
                self._load_from_checkpoint(resume_from_checkpoint)
            return TrainOutput(self.training_steps(), math.nan, metrics)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.privacy_run.finish(output.metrics)
        return output

    # ------------------------------------------------------------------ reporting
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.pop("grad_norm", None)  # a norm of un-clipped, un-noised gradients: not private
        self.privacy_run.epsilon_to_log(logs)
        super().log(logs, start_time)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: Trainer's count (6 × tokens × parameters) is an exact function of each Poisson batch's private token
        count, and it is saved in trainer_state.json and returned as `total_flos`."""
        return 0

    # ------------------------------------------------------------------ evaluation: held out or not
    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                 **kwargs: Any) -> dict[str, float]:
        """The class's evaluate, recording its metrics and whether the card may call them held-out.

        Only metrics computed here reach the card, each with the verdict on the very set that produced it (a dict
        of sets recurses here once per set, under the prefix eval_<name>).
        """
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, str):  # Trainer's recursion over a dict names self.eval_dataset's entries
            dataset = self.eval_dataset[dataset]
        if isinstance(dataset, dict) or dataset is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        metrics = self._evaluations.record(metric_key_prefix, partial(
            super().evaluate, eval_dataset, ignore_keys, metric_key_prefix, **kwargs))
        settings = self.privacy_run.collapse_settings(self.args.learning_rate)
        self._evaluations.predictions.warn_if_collapsed(metric_key_prefix, self.model, settings, reduce=(
            partial(self.accelerator.reduce, reduction="sum") if self.args.world_size > 1 else None))
        return metrics

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Trainer's, once the set it reads is judged held out or not (`held_out.Evaluations.reading`): here the set
        is as the class's evaluate prepared it (TRL tokenizes, appends an EOS to and packs a set passed to evaluate)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is not None:
            self._evaluations.reading(self.eval_dataset[dataset] if isinstance(dataset, str) else dataset)
        return super().get_eval_dataloader(eval_dataset)

    # ------------------------------------------------------------------ saving and the card
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            self.privacy_run.save(output_dir)
            self._write_card(output_dir)

    @property
    def adapter_format(self) -> str:
        """How save_model stores the result: 'peft', 'private_adapter' (only the trained tensors) or 'full'."""
        return adapter_format(self.model, self.trained_parameter_names)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Checkpoints and final saves alike write only what was trained (see `hf_private.release.adapters`)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.adapter_format != "private_adapter":
            super()._save(output_dir, state_dict)
            if self.args.should_save:
                withhold_local_base_path(output_dir)
        elif self.args.should_save:
            save_private_checkpoint(self.model, output_dir, self.trained_parameter_names, self.processing_class,
                                    self.args)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
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
        self._reloaded_best = reloaded_checkpoint(self.state, self.args.metric_for_best_model,
                                                  self._evaluations.results)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs: Any):
        """Trainer's push (transformers 5.x), but only the allow-listed artefacts of `hf_private.release.artifacts` go
        up
        (see `hf_private.trainer.publish`): Trainer would upload the whole output directory."""
        return push_release(self, self._upload_to_hub, commit_message, blocking, token, revision, private, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's checkpoint push, but never a checkpoint folder, and only allow-listed files, copied together."""
        push_checkpoint(self, self._upload_to_hub, checkpoint_folder)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
        if self.is_world_process_zero():
            self._write_card(self.args.output_dir, model_name=model_name, finetuned_from=finetuned_from,
                             tags=[tags] if isinstance(tags, str) else tags, dataset=dataset, license=license,
                             dataset_tags=[dataset_tags] if isinstance(dataset_tags, str) else dataset_tags)

    def _write_card(self, output_dir: str, **publication: Any) -> None:
        """README.md, built by `release.card_facts` from what this run knows (the keywords: create_model_card's)."""
        write_card(output_dir, RunFacts.of_run(
            self.privacy_run, adapter_format=self.adapter_format, learning_rate=self.args.learning_rate,
            hub_id=self.args.hub_model_id or getattr(self, "hub_model_id", None), global_step=self.state.global_step,
            optimizer=optimizer_name(self.optimizer), evaluations=self._evaluations.results,
            reloaded_best=getattr(self, "_reloaded_best", None)), **publication)


class PrivateTrainer(PrivateTrainingMixin, Trainer):
    """`transformers.Trainer` made differentially private: Poisson batches, each example's gradient clipped, noise
    once per logical batch, and ε accounted, logged and written on the model card.

    Args:
        model: the model itself (a `PreTrainedModel` or `PeftModel`, not its name); the DP method may choose what
            trains, after every check has passed.
        args: `TrainingArguments`, as for Trainer; `per_device_train_batch_size × gradient_accumulation_steps ×
            processes` is the expected logical batch. Settings DP-SGD cannot honour are refused here, by name.
        dp_config: the DP method and its privacy settings (`DPConfig`, `BitFitConfig`, `FrostConfig`,
            `SparseLowRankConfig`, `DPFPConfig`): target ε or noise multiplier, δ, clip norm C, accountant, privacy
            unit.
        per_example_loss: `fn(model, outputs, labels)` returning one loss per example (shape `[B]`), for a loss the
            model's own head does not compute; None uses the head's (cross-entropy, MSE, a causal LM's per-sequence
            mean).
        packed_row_tokens: with a packing collator (`DataCollatorWithFlattening`, TRL's `padding_free=True`), a
            chunk's examples are laid end to end in rows of at most this many tokens, each still clipped alone.
            "auto": `packing.PACKED_ROW_TOKENS` under masked attention (eager, SDPA), one row a chunk under flash
            attention; None: one row a chunk.
        packed_forward_tokens: with packing, at most this many padded tokens in one forward pass (None: a chunk's
            rows in one forward).
        **trainer_kwargs: every other keyword is Trainer's own (`train_dataset`, `eval_dataset`, `data_collator`,
            `processing_class`, `compute_metrics`, `callbacks`, `optimizer_cls_and_kwargs`, ...). The training set
            must be map-style (its size N sets the sampling rate).

    Raises:
        ValueError, TypeError: at construction, for every setting, model or training set private training cannot
            honour (see `hf_private.trainer.preflight`), with the fix named.
    """


_PRIVATE_CLASSES: dict[type[Trainer], type[Trainer]] = {Trainer: PrivateTrainer}


def privatize(trainer_class: type[Trainer]) -> type[Trainer]:
    """The private subclass of `trainer_class` (a `transformers.Trainer` subclass): the same class plus `dp_config`.

    Its own metrics, callbacks, evaluation (`predict_with_generate` included) and data collator are kept; what would
    change what is clipped (a `training_step`, a batch-level `compute_loss` without `per_example_loss`, a sampler or
    optimizer, in any class of its MRO, mixins included) is refused when the trainer is built, by name and with the
    reason; such a method patched in afterwards, by `train()` before the first step.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"privatize takes a transformers.Trainer subclass, got {trainer_class!r}.")
    if issubclass(trainer_class, PrivateTrainingMixin):
        return trainer_class
    if trainer_class not in _PRIVATE_CLASSES:
        name = f"Private{trainer_class.__name__}"
        _PRIVATE_CLASSES[trainer_class] = type(name, (PrivateTrainingMixin, trainer_class), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"`{trainer_class.__name__}` plus `dp_config` (see `hf_private.privatize`).",
        })
    return _PRIVATE_CLASSES[trainer_class]


def _grouped(units: list[int]) -> list[int] | None:
    """Examples per unit for the probe, None when every unit is one example (the probe then names examples)."""
    return units if any(n != 1 for n in units) else None


def _positional_names(cls: type) -> list[str]:
    """The names the trainer gives its positional parameters: those of the nearest `__init__` after the mixin that
    names them (a subclass that passes `*args` on is skipped; its own keywords pass through untouched)."""
    for klass in cls.__mro__[cls.__mro__.index(PrivateTrainingMixin) + 1:]:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
        if not any(p.kind is p.VAR_POSITIONAL for p in parameters):
            return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return []


class _LogicalBatchBoundaries(TrainerCallback):
    """Trainer's hooks around every optimizer step.

    Begin: refuse a private-path method patched since the trainer was built (`preflight.check_private_path_unchanged`),
    and reset the engine, so an interrupted batch never joins the next. End: stop once the budget allows no
    further step, so the loop ends with global_step equal to the ledger's steps (not one empty step later).
    """

    def __init__(self, trainer: PrivateTrainingMixin) -> None:
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        check_private_path_unchanged(self.trainer, self.trainer._private_path)  # e.g. patched by a callback
        self.trainer.privacy_run.before_step()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer.privacy_run.may_step():
            self.trainer._stop_for_budget()
