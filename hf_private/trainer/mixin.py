"""`PrivateTrainingMixin`: Trainer's training hooks, made private (`privatize` places it first in the MRO).

Trainer glue only: the privacy unit's Poisson batch sampler (`data.units`) → physical chunks of whole units
(`data.chunks`) → engine hooks clip per unit during the one backward pass → the noisy optimizer adds noise once per
logical batch → the ledger records the step. Every privacy decision is the run's (`run.privacy_run.PrivacyRun`);
saving, loading, pushing and the card are the publishing hooks' (`trainer.publish.ReleaseHooks`), the held-out
verdicts the evaluation hooks' (`trainer.evaluation_hooks.EvaluationHooks`), and the run's state is read under the
trainer's names (`trainer.run_attributes.RunAttributes`). The model stays the user's own `PreTrainedModel`/`PeftModel`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from accelerate.utils.memory import clear_device_cache
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import TrainOutput

from ..data import chunks
from ..data.chunks import PhysicalChunk
from ..data.labels import log_ignored_labels
from ..data.packing import PACKED_FORWARD_TOKENS, check_packing_tokens
from ..data.sampling import EmptySafeCollator, batch_size_of
from ..data.units import units_for
from ..engine import PerExampleGradientEngine
from ..engine.independence import PROBE_EXAMPLES, probe_example_independence, spread_by_length
from ..evaluation.held_out import Evaluations, TrainingRows, pad_token_id
from ..integrations.losses import PerExampleLoss, check_per_example_losses
from ..logs import get_logger
from ..methods import MethodConfig
from ..models.head_choice import warn_if_cls_head_on_mean_encoder
from ..optimizer import noisy_optimizer
from ..privacy.rng import SecretRandom
from ..release.checkpoints import resolve_checkpoint
from ..run.privacy_run import PrivacyRun
from . import sharded
from .evaluation_hooks import EvaluationHooks
from .preflight import (
    check_before_trainer,
    check_built_trainer,
    check_private_path_unchanged,
    private_path_functions,
)
from .publish import ReleaseHooks
from .run_attributes import RunAttributes
from .step_boundaries import LogicalBatchBoundaries

logger = get_logger(__name__)


class PrivateTrainingMixin(RunAttributes, EvaluationHooks, ReleaseHooks):
    """Placed first in the MRO by `privatize`: a Trainer (sub)class plus `dp_config`; every other keyword is the
    class's own."""

    def __init__(
        self,
        *trainer_args: Any,
        dp_config: MethodConfig,
        per_example_loss: PerExampleLoss | None = None,
        packed_row_tokens: int | str | None = "auto",
        packed_forward_tokens: int | None = PACKED_FORWARD_TOKENS,
        **trainer_kwargs: Any,
    ) -> None:
        names = _positional_names(type(self))  # DPOTrainer's second positional parameter is ref_model
        given = {**dict(zip(names, trainer_args)), **trainer_kwargs}
        model, args = given.get("model"), given.get("args")
        # before Trainer, which creates the Hub repo when push_to_hub is set (see preflight)
        checked = check_before_trainer(
            type(self),
            PrivateTrainingMixin,
            model,
            args,
            dp_config,
            per_example_loss,
            given.get("train_dataset"),
            {k: v for k, v in given.items() if k not in ("model", "args")},
        )
        # packed chunks: rows of whole examples, several to a forward (hf_private.data.packing)
        self.packed_row_tokens, self.packed_forward_tokens = check_packing_tokens(
            packed_row_tokens, packed_forward_tokens
        )
        self.dp_method = dp_config.build_method()
        warn_if_cls_head_on_mean_encoder(checked.model)
        self.dataset_size = checked.dataset_size
        model = self.dp_method.wrap_model(checked.model)  # after every check: a refused run leaves the model as it was
        self.dp_method.prepare_model(model)
        if "model" in names[: len(trainer_args)]:
            trainer_args = (
                tuple(model if name == "model" else value for name, value in zip(names, trainer_args))
                + trainer_args[len(names) :]
            )
        else:
            trainer_kwargs["model"] = model
        super().__init__(*trainer_args, **trainer_kwargs)
        self.dp_config = dp_config
        expected = check_built_trainer(self, args is not None, dp_config, per_example_loss, checked)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) or sharded.requested_plugin(self.args)
        self.fsdp2_sharded = plugin is not None  # sharded before the engine is built on the parameters (.sharded)
        if plugin is not None:
            sharded.shard_for_training(self, plugin)
        self.trainer_family = checked.family  # the unit, its rows and loss (hf_private.integrations)
        self.train_dataset = checked.family.training_set(self.train_dataset, self.args)
        # the privacy unit, chosen once; its users read again if the trainer prepared a new dataset (TRL tokenizes)
        users = checked.users if self.train_dataset is given.get("train_dataset") else None
        self.units = units_for(
            dp_config,
            self.args,
            self.train_dataset,
            users=users,
            cap=lambda index: self.privacy_run.kept_by_users(index, self.train_dataset, self._from_main_process),
        )
        # what the private path's functions resolve to, compared again before training and before every step
        self._private_path = private_path_functions(self, per_example_loss is not None)
        self.per_example_loss = per_example_loss or checked.family.per_unit_loss(self.args)
        self.custom_per_example_loss = per_example_loss is not None  # packed chunks need the family's own loss
        self.privacy_run = PrivacyRun(
            dp_config,
            self.dp_method,
            self.model,
            self,
            self.dataset_size,
            checked.delta,
            expected,
            getattr(self.train_dataset, "_fingerprint", None),
            checked.unit,
        )
        # the logged loss is a mean per example: under ULS a sampled user brings up to k examples
        self._examples_per_batch = self.units.examples_per_batch(self.sample_rate, expected)
        self.add_callback(LogicalBatchBoundaries(self))
        self._set_signature_columns_if_needed()  # a list: Trainer leaves it unannotated, set to None in its __init__
        training_rows = TrainingRows(
            self.train_dataset,
            self._signature_columns,  # type: ignore[arg-type]
            [*self.label_names, *checked.family.derived_columns],
            pad_token_id(self.processing_class),
            checked.family.unmarked_units(self.args),
        )
        self._evaluations = Evaluations(training_rows, self.eval_dataset)
        self.privacy_run.log_plan(self.units.users)
        log_ignored_labels(checked.labels)

    # ------------------------------------------------------------------ data: the privacy unit's (data.units)
    def training_data(self) -> tuple[Any, Callable]:
        """The set the sampler draws from (the training set as the model reads it, unused columns removed, in the
        unit's view) and its empty-batch-safe collator."""
        dataset = self.train_dataset
        assert dataset is not None  # preflight.check_dataset refused a missing training set
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        collate = EmptySafeCollator(self.trainer_family.training_collator(self.data_collator), dataset[0])
        return self.units.training_view(dataset, collate)

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
        lengths = self.units.chunk_lengths(self.train_dataset, self.processing_class, dataset, collate)
        sampler = self.privacy_run.training_sampler(
            self.units, dataset, self.args.gradient_accumulation_steps, lengths, self._from_main_process
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def poisson_chunks(self, dataset: Any, sample_rate: float, random: SecretRandom) -> list[list[int]]:
        """This process's share of one Poisson sample of units (a method's own release, e.g. DP-FROST's selection),
        as indices into `dataset` (`training_data()`'s) in physical chunks of whole units."""
        return self.units.poisson_sample(dataset, sample_rate, random)

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
        """Forward/backward `inputs` in physical chunks of whole units (`data.chunks`: users at user level, each with
        all of its examples; packed chunks as rows of whole units), each unit's terms into `engine`; the summed loss.
        The first chunk of ≥ 2 units of the run, and the first after every switch of the trainable set, is probed for
        unit independence, together with a probe chunk from the training set."""
        total = torch.zeros((), device=self.args.device)
        physical: Iterable[PhysicalChunk] = chunks.physical_chunks(
            inputs,
            model,
            self.args.per_device_train_batch_size,
            partial(self.trainer_family.rows_per_unit, model),
            packed_row_tokens=self.packed_row_tokens,
            packed_forward_tokens=self.packed_forward_tokens,
        )
        if self.fsdp2_sharded:  # every process joins FSDP2's collectives of each chunk: as many chunks on each
            physical = list(physical)
            padding = sharded.padding_chunks(physical, self.args.device)
            sharded.sync_gradients(model)
        for chunk in physical:
            with engine.recording(len(chunk.units), chunk.unit_rows, packed=chunk.layout):
                total = total + self._chunk_step(model, chunk.inputs)
            engine.finish_backward()
            if len(chunk.units) >= 2 and self.privacy_run.needs_independence_probe and not self.fsdp2_sharded:
                self._probe_example_independence(model, chunk, engine)
        if self.fsdp2_sharded:
            sharded.join_the_other_chunks(self, model, engine, padding)
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
            if callable(optimizer_train := getattr(self.optimizer, "train", None)):
                optimizer_train()
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

    def _probe_example_independence(
        self, model: nn.Module, chunk: PhysicalChunk | None, engine: PerExampleGradientEngine
    ) -> None:
        """Units recomputed alone must get the norms they had in this chunk and in a chunk of training examples
        spread over their lengths, collated as training chunks are (sharded: the latter alone, `chunk` None, since
        every process must run the same forwards)."""
        dataset, collate = self.training_data()
        indices = self.units.in_unit_order(
            spread_by_length(dataset, count=min(PROBE_EXAMPLES, self.args.per_device_train_batch_size))
        )
        probe, probe_units = chunks.unit_sizes_of(collate([dataset[i] for i in indices]))
        probe = self._prepare_inputs(probe)
        low_precision = self.args.bf16 or any(p.dtype in (torch.float16, torch.bfloat16) for _, p in engine.parameters)
        probe_rows = self.trainer_family.rows_per_unit(model, probe)
        probed = [(probe, len(indices), probe_rows, _grouped(probe_units))]
        if chunk is not None:
            units = chunk.units
            probed.insert(0, (self._prepare_inputs(chunk.inputs), sum(units), chunk.rows_per_example, _grouped(units)))
        probe_example_independence(engine, model, probed, self._training_loss, low_precision)
        self.privacy_run.needs_independence_probe = False

    def _stop_for_budget(self) -> None:
        self.privacy_run.stop_for_budget()
        self.control.should_training_stop = True

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        check_private_path_unchanged(self, self._private_path)  # a patch after construction, before anything runs
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self._output_dir) if resume_from_checkpoint else None
        if checkpoint is not None:
            self.privacy_run.resume(checkpoint, self._output_dir)
        requested = self.args.max_steps if self.args.max_steps > 0 else self.planned_steps
        if not self.privacy_run.begin(requested, resumed=checkpoint is not None):
            # No step is possible: load the checkpoint's weights (what save/push will publish), train nothing.
            metrics = self.privacy_run.spent_already(checkpoint)
            if checkpoint is not None:
                self._load_from_checkpoint(checkpoint)
            return TrainOutput(self.training_steps(), math.nan, metrics)
        output = super().train(checkpoint or resume_from_checkpoint, *args, **kwargs)
        self.privacy_run.finish(output.metrics)
        return output

    # ------------------------------------------------------------------ reporting
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.pop("grad_norm", None)  # a norm of un-clipped, un-noised gradients: not private
        self.privacy_run.epsilon_to_log(logs)
        self.privacy_run.clip_to_log(logs)
        super().log(logs, start_time)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: Trainer's count (6 × tokens × parameters) is an exact function of each Poisson batch's private token
        count, and it is saved in trainer_state.json and returned as `total_flos`."""
        return 0


def _grouped(units: list[int]) -> list[int] | None:
    """Examples per unit for the probe, None when every unit is one example (the probe then names examples)."""
    return units if any(n != 1 for n in units) else None


def _positional_names(cls: type) -> list[str]:
    """The names the trainer gives its positional parameters: those of the nearest `__init__` after the mixin that
    names them (a subclass that passes `*args` on is skipped; its own keywords pass through untouched)."""
    for klass in cls.__mro__[cls.__mro__.index(PrivateTrainingMixin) + 1 :]:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
        if not any(p.kind is p.VAR_POSITIONAL for p in parameters):
            return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return []
