"""`privatize(TrainerClass)`: any `transformers.Trainer` subclass, made differentially private; `PrivateTrainer` is
`Trainer` made so.

Wiring: Poisson batch sampler → physical chunks → engine hooks clip per example during the one
backward pass → `NoisyOptimizer.step` adds noise once per logical batch → ledger records the step. The model
stays the user's own `PreTrainedModel`/`PeftModel`, so saving, evaluation and `push_to_hub` work as usual.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from .adapters import (
    adapter_format,
    auxiliary_parameter_names,
    has_private_adapter,
    load_adapter_weights,
    private_adapter_names,
    withhold_local_base_path,
)
from .artifacts import has_trainer_weights
from .audit import AuditResult, compose_audits
from .card_facts import RunFacts, optimizer_name, reloaded_checkpoint, write_card
from .checkpoints import (
    load_dp_config_dict,
    load_ledger,
    load_method_state,
    save_privacy_record,
    save_private_checkpoint,
)
from .engine import PerExampleGradientEngine, trainable_parameters
from .engine.independence import (
    PROBE_EXAMPLES,
    RTOL,
    RTOL_LOW_PRECISION,
    check_example_independence,
    spread_by_length,
)
from .example_rows import rows_per_example
from .forks import find_fork
from .head_choice import warn_if_cls_head_on_mean_encoder
from .held_out import HELD_OUT, OVERLAPS, TrainingRows, eval_sets, pad_token_id, published_metrics
from .hub import AllowListedUpload, push_checkpoint, push_release
from .label_checks import log_ignored_labels
from .logs import get_logger
from .losses import PerExampleLoss, check_per_example_losses, default_per_example_loss
from .method_run import MethodRun
from .methods import MethodConfig
from .optimizer import NoisyOptimizer, noisy_optimizer
from .prediction_collapse import HeldOutPredictions, RunSettings
from .preflight import check_before_trainer, check_built_trainer
from .privacy import GaussianNoise, MechanismGroup, PrivacyLedger, PrivacyPlan, compute_epsilon
from .privacy.epsilon_log import EpsilonLog, horizon_cap
from .sampling import (
    EmptySafeCollator,
    PoissonBatchSampler,
    batch_size_of,
    example_lengths,
    sampling_random,
)

logger = get_logger(__name__)

# Noise std per coordinate of the averaged update, in units of C (σ / expected batch), above which a run is warned
# that it will learn little: a rule of thumb (usual DP fine-tuning runs sit near 1e-3; 0.05 means twenty perfectly
# aligned clipped gradients per step to match one noise standard deviation).
NOISY_UPDATE = 0.05


class PrivateTrainingMixin:
    """Placed first in the MRO by `privatize`: a Trainer (sub)class plus `dp_config`; every other keyword is the
    class's own."""

    loss_is_scaled_for_ga = True  # our loss is a per-example sum; Trainer must not rescale it

    def __init__(
        self,
        model: nn.Module | None = None,
        args=None,
        *trainer_args: Any,
        dp_config: MethodConfig,
        per_example_loss: PerExampleLoss | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        train_dataset = trainer_kwargs.get("train_dataset", trainer_args[1] if len(trainer_args) > 1 else None)
        # before Trainer, which creates the Hub repo when push_to_hub is set (see preflight)
        checked = check_before_trainer(type(self), PrivateTrainingMixin, model, args, dp_config, per_example_loss,
                                       train_dataset, trainer_kwargs)
        self.dp_method = dp_config.build_method()
        warn_if_cls_head_on_mean_encoder(model)
        self.dataset_size = checked.dataset_size
        model = self.dp_method.wrap_model(model)  # after every check: a refused run leaves the model as it was
        self.dp_method.prepare_model(model)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._upload_to_hub = AllowListedUpload()
        self.dp_config = dp_config
        self.expected_batch_size = check_built_trainer(self, args is not None, dp_config, per_example_loss,
                                                       self.dataset_size)
        self.per_example_loss = per_example_loss or partial(
            default_per_example_loss, label_smoothing=self.args.label_smoothing_factor)
        self.delta = checked.delta
        schedule = {"steps": self.args.max_steps} if self.args.max_steps > 0 else {"epochs": self.args.num_train_epochs}
        self.plan = PrivacyPlan(
            self.dataset_size, self.expected_batch_size, **schedule, delta=self.delta, accountant=dp_config.accountant,
            target_epsilon=dp_config.target_epsilon, noise_multiplier=dp_config.noise_multiplier,
            stages=self.dp_method.stages(),
        )
        self.sample_rate, self.steps_per_epoch = self.plan.sample_rate, self.plan.steps_per_epoch
        self.planned_steps = self.plan.planned_steps
        self.stage = self.plan.stage_at(0)
        self.ledger = PrivacyLedger(self.dataset_size, self.delta, dp_config.accountant)
        self.engine = self._new_engine()
        self._engine_suspended = False
        self._method_run = MethodRun(self)
        self.add_callback(_LogicalBatchBoundaries(self))
        seed = dp_config.noise_seed  # test mode: a stream of its own, apart from the optimizer's
        self._forward_mechanisms = self.dp_method.attach_forward_mechanisms(
            self.model, GaussianNoise(self.args.device, test_seed=None if seed is None else seed + 104729), self.plan)
        # Every tensor trained in any stage: what a saved adapter must contain.
        self.trained_parameter_names = self.dp_method.trained_parameter_names(self.model)
        self._step_limit: int | None = None
        self._epsilon_log = EpsilonLog(self.ledger, 0)  # the ε of the log lines; train() starts a new one
        self._budget_exhausted = False
        self._early_stop_reason: str | None = None  # why the budget stops training before the plan, if it will
        # the example-independence probe runs on the first chunk of ≥ 2 and again after every trainable-set switch
        self._independence_checked = False
        self._audits: list[AuditResult] = []  # see attach_audit
        self._set_signature_columns_if_needed()
        self.training_rows = TrainingRows(self.train_dataset, self._signature_columns, self.label_names,
                                          pad_token_id(self.processing_class))
        # metric key prefix → (HELD_OUT or OVERLAPS, the metrics of its last evaluate() in this process)
        self._eval_results: dict[str, tuple[str, dict[str, float]]] = {}
        self._held_out_predictions = HeldOutPredictions()  # counted in compute_loss, checked after evaluate()
        for prefix, dataset in eval_sets(self.eval_dataset):
            self.training_rows.overlap(dataset, prefix)  # warns now, before any training
        self._log_plan()
        log_ignored_labels(checked.labels)

    # ------------------------------------------------------------------ validation and plan
    def _log_plan(self) -> None:
        if not self.plan.has_guarantee:
            logger.warning("Training plan WITHOUT a privacy guarantee (%s): N=%d examples, q=%.5g, %d steps. %s",
                           self.mechanism_name, self.dataset_size, self.sample_rate, self.planned_steps,
                           self.plan.guarantee[1])
            return
        target = self.dp_config.target_epsilon
        if self.dp_config.noise_seed is not None:  # calibrated as usual, but the known seed replays the noise
            logger.warning(
                "Training plan in insecure test mode, WITHOUT a privacy guarantee (%s): N=%d examples, q=%.5g, %d "
                "steps, noise multiplier σ=%.4g%s, clip norm C=%g. DPConfig.noise_seed replays the noise and "
                "sampling: never publish this model as private.", self.mechanism_name, self.dataset_size,
                self.sample_rate, self.planned_steps, self.noise_multiplier,
                "" if target is None else f" (calibrated as for target {target:g})", self.dp_config.max_grad_norm,
            )
        else:
            logger.info(
                "Private training plan (%s): N=%d examples, sampling rate q=%.5g (expected logical batch %d), %d "
                "steps, noise multiplier σ=%.4g, clip norm C=%g, δ=%.3g, %s accountant%s.",
                self.mechanism_name, self.dataset_size, self.sample_rate, self.expected_batch_size, self.planned_steps,
                self.noise_multiplier, self.dp_config.max_grad_norm, self.delta, self.dp_config.accountant,
                "" if target is None else f", target ε={target:g}",
            )
        noise_per_batch = self.noise_multiplier / self.expected_batch_size
        if noise_per_batch > NOISY_UPDATE:
            logger.warning(
                "The model will be mostly noise: σ=%.4g over an expected batch of %d examples puts noise of %.3g·C on "
                "every coordinate of each averaged update (learning usually needs well under %g·C). Use a larger "
                "logical batch (per_device_train_batch_size × gradient_accumulation_steps), fewer epochs, more "
                "data, or a larger target ε.", self.noise_multiplier, self.expected_batch_size, noise_per_batch,
                NOISY_UPDATE,
            )

    def _new_engine(self) -> PerExampleGradientEngine:
        """The engine for the current trainable set, with the method's reducer and term transforms."""
        engine = PerExampleGradientEngine(self.model, self.dp_config.max_grad_norm)
        engine.attach()
        self.dp_method.attach_engine(engine)
        return engine

    @property
    def noise_multiplier(self) -> float:
        """σ of the current training stage; 0 for a stage that claims no guarantee and adds no gradient noise (DP-FP in
        paper mode)."""
        sigma = self.stage.noise_multiplier
        if sigma is None and self.stage.stage.no_guarantee is not None:
            return 0.0
        return sigma

    @property
    def mechanism_name(self) -> str:
        return self.stage.name

    def training_steps(self) -> int:
        """Training steps released so far (the ledger may also hold a method's own releases, e.g. selection)."""
        return self.plan.training_steps(self.ledger.mechanisms)

    def record_release(self, stage: str, steps: int = 1) -> None:
        """A method's own release of one of its planned stages (e.g. DP-FROST's selection rounds) joins the ledger."""
        self.ledger.record_event(self.plan.event(stage, steps, self.dp_config.max_grad_norm))

    def _maybe_start_next_phase(self) -> None:
        """Between logical batches: switch to the next training stage's trainable set once its step is reached."""
        stage = self.plan.stage_at(self.training_steps())
        if stage.name == self.stage.name:
            return
        self.stage = stage
        self.dp_method.start_stage(self.plan.training_stages.index(stage), self.model)
        self._rebuild_engine()
        logger.info("Stage %s starts after %d training steps: %d trainable tensors, σ=%.4g.", self.mechanism_name,
                    self.training_steps(), len(self.engine.parameters), self.noise_multiplier)

    def _before_step(self) -> None:
        """At the start of a logical batch: the method's own releases and re-selection (`DPMethod.before_step`)."""
        if not self._may_step():
            return
        before = [name for name, _ in trainable_parameters(self.model)]
        self.dp_method.before_step(self._method_run, self.training_steps())
        if self._engine_suspended or [name for name, _ in trainable_parameters(self.model)] != before:
            self._rebuild_engine()

    def suspend_training_engine(self) -> None:
        """Detach the training engine while a method records with its own (`MethodRun.new_engine`)."""
        if not self._engine_suspended:
            self.engine.detach()
            self._engine_suspended = True

    def _rebuild_engine(self) -> None:
        """A new training engine for the current trainable set; the optimizer keeps every stage's parameters (those
        not trainable now get no gradient)."""
        if not self._engine_suspended:
            self.engine.detach()
        self.engine = self._new_engine()
        self._engine_suspended = False
        self._independence_checked = False  # a new trainable set: probe it again
        self.trained_parameter_names |= self.dp_method.trained_parameter_names(self.model)
        optimizer = noisy_optimizer(self.optimizer)
        if optimizer is not None:
            optimizer.engine, optimizer.noise_multiplier = self.engine, self.noise_multiplier

    # ------------------------------------------------------------------ data
    def training_data(self) -> tuple[Any, EmptySafeCollator]:
        """The training set as the model reads it (unused columns removed) and its empty-batch-safe collator."""
        dataset = self.train_dataset
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        return dataset, EmptySafeCollator(self.data_collator, dataset[0])

    def get_train_dataloader(self) -> DataLoader:
        """A plain DataLoader with a Poisson batch sampler (not passed through Accelerate: it would re-shard)."""
        dataset, collate = self.training_data()
        sampler = PoissonBatchSampler(
            len(dataset), self.sample_rate, self.steps_per_epoch, self.args.gradient_accumulation_steps,
            rank=self.args.process_index, world_size=self.args.world_size,
            random=sampling_random(self.dp_config.noise_seed), lengths=self._example_lengths(),
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _example_lengths(self) -> torch.Tensor | None:
        """Lengths for length-sorted chunks when TrainingArguments asks to group by length (else None)."""
        if getattr(self.args, "train_sampling_strategy", "random") != "group_by_length":
            return None
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        return example_lengths(self.train_dataset, self.args.length_column_name, names[0])

    # ------------------------------------------------------------------ optimisation
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        noisy = noisy_optimizer(self.optimizer)  # Trainer may call again with it wrapped by Accelerate
        if noisy is not None:
            self.optimizer = noisy
            return noisy
        inner = super().create_optimizer(model)
        self.optimizer = NoisyOptimizer(
            inner,
            self.engine,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.dp_config.max_grad_norm,
            expected_batch_size=self.expected_batch_size,
            noise=GaussianNoise(self.args.device, test_seed=self.dp_config.noise_seed),
            may_step=self._may_step,
            on_step=self._record_step,
        )
        self.dp_method.attach_optimizer(self.optimizer)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            labels = inputs.get("labels")  # before Trainer's label smoother pops them
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            self._held_out_predictions.add(model, outputs, labels)
            return (loss, outputs) if return_outputs else loss
        if "labels" not in inputs:
            raise ValueError(f"Training batches need a 'labels' entry; got keys {sorted(inputs)}.")
        loss, outputs = self._summed_loss(model, inputs)
        return (loss, outputs) if return_outputs else loss

    def _summed_loss(self, model: nn.Module, inputs: dict) -> tuple[torch.Tensor, Any]:
        """Σ_b ℓ_b with the per-example loss, in whatever mode the model is (the independence probe runs eval)."""
        inputs = dict(inputs)
        examples = batch_size_of(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = check_per_example_losses(self.per_example_loss(model, outputs, labels), examples)
        # A non-finite ℓ_b gets zero gradient through where(), and the engine zeroes whatever NaN still reaches its
        # terms; the logged loss must not become NaN exactly when that record is sampled either.
        return torch.where(torch.isfinite(losses), losses, 0.0).sum(), outputs

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward/backward in physical chunks of at most per_device_train_batch_size, each clipped per example."""
        zero = torch.zeros((), device=self.args.device)
        self._maybe_start_next_phase()
        if not self._may_step():
            self._stop_for_budget()
            return zero
        # The unwrapped model: DDP must not all-reduce un-clipped gradients (the optimizer reduces clipped sums).
        total = self.record_chunks(self.accelerator.unwrap_model(model), inputs, self.engine)
        return total / (self.expected_batch_size / self.args.world_size)

    def record_chunks(self, model: nn.Module, inputs: dict, engine: PerExampleGradientEngine) -> torch.Tensor:
        """Forward/backward `inputs` in chunks of at most per_device_train_batch_size, each example's terms into
        `engine`; the summed loss. The first chunk of ≥ 2 examples of the run, and the first after every switch of the
        trainable set, is probed for example independence, together with a probe chunk from the training set."""
        size = batch_size_of(inputs)
        rows = rows_per_example(model, inputs)
        chunk = self.args.per_device_train_batch_size
        total = torch.zeros((), device=self.args.device)
        for start in range(0, size, chunk):
            part = {k: _slice(v, size, start, start + chunk) for k, v in inputs.items()}
            examples = min(chunk, size - start)
            with engine.recording(examples, rows):
                total = total + super().training_step(model, part, None)
            engine.finish_backward()
            if examples >= 2 and not self._independence_checked:
                self._check_example_independence(model, part, examples, rows, engine)
        return total

    def _check_example_independence(self, model: nn.Module, inputs: dict, examples: int, rows: int,
                                    engine: PerExampleGradientEngine) -> None:
        """Examples recomputed alone must get the norms they had in a chunk: this real chunk, then a probe chunk of
        training examples spread over their lengths (which a length-sorted or unpadded real chunk may not show)."""
        low_precision = self.args.bf16 or any(p.dtype in (torch.float16, torch.bfloat16)
                                              for _, p in engine.parameters)

        def summed_loss(model: nn.Module, batch: dict) -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self._summed_loss(model, batch)[0]

        rtol = RTOL_LOW_PRECISION if low_precision else RTOL
        check_example_independence(engine, model, self._prepare_inputs(inputs), summed_loss, examples, rows,
                                   rtol=rtol)
        probe, probe_examples = self._length_spread_chunk()
        check_example_independence(engine, model, probe, summed_loss, probe_examples,
                                   rows_per_example(model, probe), rtol=rtol)
        self._independence_checked = True

    def _length_spread_chunk(self) -> tuple[dict, int]:
        """A chunk of training examples spread over their lengths, collated as training chunks are."""
        dataset, collate = self.training_data()
        indices = spread_by_length(dataset, count=min(PROBE_EXAMPLES, self.args.per_device_train_batch_size))
        return self._prepare_inputs(dict(collate([dataset[i] for i in indices]))), len(indices)

    def _may_step(self) -> bool:
        return self._step_limit is None or self.training_steps() < self._step_limit

    def _record_step(self) -> None:
        self.record_release(self.mechanism_name)

    def _stop_for_budget(self) -> None:
        """Stop once the target allows no further step. At the planned end that is the normal end (train() logs ε at
        INFO); before it, a WARNING says why (`_warn_if_budget_ends_early` said so at the start too)."""
        asked = self._requested_steps()
        early = self.training_steps() < asked
        if not self._budget_exhausted and early and not self.has_formal_guarantee:
            logger.warning("The planned budget allows no further step after %d of %d steps (insecure test mode: the "
                           "accounting bounds nothing). Stopping training.", self.training_steps(), asked)
        elif not self._budget_exhausted and early:
            logger.warning(
                "Privacy budget reached after %d of the %d steps asked for: ε=%.4g of target %.4g. Stopping training "
                "so the budget is not exceeded (%s).", self.training_steps(), asked, self.ledger.epsilon(),
                self.dp_config.target_epsilon, self._early_stop_reason or "the schedule changed after calibration",
            )
        self._budget_exhausted = True
        self.control.should_training_stop = True

    def _warn_if_budget_ends_early(self, resumed: PrivacyLedger | None) -> None:
        """Say before the first step when the target will stop training short of the plan, and why."""
        self._early_stop_reason = None
        asked = self._requested_steps()
        if self._step_limit is None or self._step_limit >= asked:
            return
        if resumed is not None and resumed.total_steps:
            self._early_stop_reason = (
                f"the checkpoint's ledger already holds {self.training_steps()} training steps taken at its own σ "
                f"(ε={resumed.epsilon():.4g} spent), while this run's σ={self.noise_multiplier:.4g} was calibrated "
                f"for all {self.planned_steps} planned steps from the start: to train them all, resume with the "
                "max_steps / num_train_epochs and target the checkpoint was planned with"
            )
        else:
            self._early_stop_reason = (f"σ={self.noise_multiplier:.4g} was calibrated for the {self.planned_steps} "
                                       f"steps planned at construction; TrainingArguments now asks for {asked}")
        logger.warning("The target ε=%g allows %d training steps in all, fewer than the %d asked for, so training will "
                       "stop at step %d: %s.", self.dp_config.target_epsilon, self._step_limit, asked,
                       self._step_limit, self._early_stop_reason)

    def _requested_steps(self) -> int:
        """The training steps TrainingArguments asks for now (the plan's count unless max_steps says otherwise)."""
        return self.args.max_steps if self.args.max_steps > 0 else self.planned_steps

    def _warn_if_config_changed(self, checkpoint: str) -> None:
        """A resume with another dp_config keeps the accounting honest (one ledger), but say what changed."""
        saved = load_dp_config_dict(checkpoint)
        if saved is None:
            return
        current = self.dp_config.to_dict()
        changed = {k: (saved.get(k), v) for k, v in current.items() if k != "format_version" and saved.get(k) != v}
        if changed:
            logger.warning(
                "Resuming from %s with a different dp_config: %s. The ledger carries on (ε already spent: %.4g over "
                "%d releases) and this run's steps add to it under the new settings.", checkpoint,
                ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changed.items()), self.ledger.epsilon(),
                self.ledger.total_steps,
            )

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint:
            checkpoint = (
                get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
            )
            if checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from.")
            self.ledger = load_ledger(checkpoint, self.dataset_size, self.delta, self.dp_config.accountant)
            self._warn_if_config_changed(checkpoint)
            self._note_fork(checkpoint)
            self.dp_method.load_state_dict(load_method_state(checkpoint))
            # what the earlier run trained stays in every adapter saved from here on (a selection made before, say)
            self.trained_parameter_names |= private_adapter_names(checkpoint)
            resume_from_checkpoint = checkpoint
        allowed = self.plan.max_training_steps(self.ledger.mechanisms)
        self._step_limit = None if allowed is None else self.training_steps() + allowed
        if not self._may_step():
            return self._budget_already_spent(resume_from_checkpoint)
        self._warn_if_budget_ends_early(self.ledger if resume_from_checkpoint else None)
        self._budget_exhausted = False
        self._epsilon_log = EpsilonLog(self.ledger, self.training_steps())
        self.engine.reset()  # an earlier train() interrupted mid-batch must not release its sums with this one's
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        report = self.privacy_report()
        if "epsilon" not in report:
            logger.warning("Trained WITHOUT a differential privacy guarantee after %d steps: %s", report["steps"],
                           report["guarantee_note"])
            return output
        output.metrics.update(epsilon=report["epsilon"], delta=report["delta"])
        target = self.dp_config.target_epsilon
        logger.info("Trained privately: ε=%.4g%s, δ=%.3g (%s) after %d of %d planned steps.", report["epsilon"],
                    "" if target is None else f" of target {target:g}", report["delta"], report["accountant"],
                    report["steps"], self.planned_steps)
        return output

    def _note_fork(self, checkpoint: str) -> None:
        """Resuming behind the newest checkpoint starts a second line of training on the same data: warn, record it."""
        fork = find_fork(self.args.output_dir, checkpoint, self.ledger)
        if fork is None:
            return
        self.ledger.record_fork(fork)
        logger.warning(
            "Resuming from %s although %s is newer: this starts a second line of training on the same data. Anything "
            "released from the later checkpoints (hub_strategy='every_save' pushes each one) stays public, and its "
            "privacy loss composes with this run's; the report and the card of this run say so%s.",
            fork["resumed_from"], fork["newer_checkpoint"],
            " and count both lines in epsilon_with_forks" if self.has_formal_guarantee else "",
        )

    def _budget_already_spent(self, checkpoint: str | None) -> TrainOutput:
        """No step is possible: say so, load the checkpoint's weights (what save/push will publish), train nothing."""
        self._budget_exhausted = True
        if not self.has_formal_guarantee:
            logger.warning("The planned budget allows no step after the %d training steps recorded in the ledger%s "
                           "(insecure test mode), so train() takes no step.", self.training_steps(),
                           f" of {checkpoint}" if checkpoint else "")
            if checkpoint:
                self._load_from_checkpoint(checkpoint)
            return TrainOutput(self.training_steps(), math.nan, {"steps_taken": 0})
        epsilon = self.ledger.epsilon()
        logger.warning(
            "The privacy budget is already spent: ε=%.4g of target ε=%.4g after the %d training steps recorded in the "
            "ledger%s, so train() takes no step. Raising target_epsilon would spend more privacy on the same data; "
            "otherwise use the model as it is.", epsilon, self.dp_config.target_epsilon, self.training_steps(),
            f" of {checkpoint}" if checkpoint else "",
        )
        if checkpoint:
            self._load_from_checkpoint(checkpoint)
        return TrainOutput(self.training_steps(), math.nan,
                           {"epsilon": epsilon, "delta": self.delta, "steps_taken": 0})

    # ------------------------------------------------------------------ reporting
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.pop("grad_norm", None)  # a norm of un-clipped, un-noised gradients: not private
        if not self.has_formal_guarantee:
            pass  # no ε to log: a number here would read as a guarantee
        elif "train_loss" in logs:  # the end of training: the exact ε, as in privacy_report() and the card
            logs["epsilon"] = self._epsilon_log.final()
        elif "loss" in logs:  # every logging step: ε spent so far, or a bound a few steps ahead (see EpsilonLog)
            steps = self.training_steps()
            end = self.state.max_steps  # Trainer's own stop (the planned steps unless args changed since)
            limit = end if self._step_limit is None else min(self._step_limit, end)
            cap = horizon_cap(self.plan, self.ledger.mechanisms, steps, limit,
                              self.dp_method.next_own_release(steps, self.plan))
            logs["epsilon"] = self._epsilon_log.at_step(steps, cap, limit)
        super().log(logs, start_time)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: Trainer's count (6 × tokens × parameters) is an exact function of each Poisson batch's private token
        count, and it is saved in trainer_state.json and returned as `total_flos`."""
        return 0

    @property
    def has_formal_guarantee(self) -> bool:
        """Whether this run's ε is a guarantee: not when a release has none (DP-FP paper mode), nor in insecure test
        mode (whoever knows `noise_seed` replays the noise). Without one, no ε is logged, reported or carded."""
        return self.plan.has_guarantee and self.dp_config.noise_seed is None

    def privacy_report(self) -> dict[str, Any]:
        """ε, δ and what they rest on. Without a formal guarantee: no `epsilon` (nor `training_epsilon`), and the
        numbers that may still be shown, labelled, under `not_a_guarantee`."""
        report = self.ledger.report()
        notes = [note for note in dict.fromkeys([self.ledger.guarantee()[1], self.plan.guarantee[1]]) if note]
        if self.dp_config.noise_seed is not None:
            notes.append(
                "Trained in insecure test mode (DPConfig.noise_seed is set): the noise and sampling can be "
                "replayed by anyone who knows the seed, so no privacy loss is bounded."
            )
        report.pop("guarantee_note", None)
        report["guarantee"] = "none" if notes else "formal"
        if notes:
            report["guarantee_note"] = " ".join(notes)
        report.update(
            steps=self.training_steps(),  # optimizer steps; a method's own releases are in `mechanisms`
            method=self.dp_config.method,
            unit="example",
            target_epsilon=self.dp_config.target_epsilon,
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            max_grad_norm=self.dp_config.max_grad_norm,
            planned_steps=self.planned_steps,
            expected_batch_size=self.expected_batch_size,
            trainable_fraction=self._trainable_fraction(),
            phases=[{"mechanism": stage.name, "from_step": stage.start_step} for stage in self.plan.training_stages],
        )
        details = self.dp_method.report()
        if details:
            report["method_details"] = details
        report = compose_audits(report, self._audits, self.ledger.accountant)
        if self.ledger.forks:
            report["forks"] = self.ledger.forks
            if report["guarantee"] == "formal" and all(fork["newer_ledger_found"] for fork in self.ledger.forks):
                both = [MechanismGroup.from_dict(m) for m in report["mechanisms"]] + [
                    MechanismGroup.from_dict(m) for fork in self.ledger.forks for m in fork["newer_releases"]]
                report["epsilon_with_forks"] = compute_epsilon(both, report["delta"], self.ledger.accountant)
        if report["guarantee"] == "formal":
            return report
        return self._without_guarantee(report)

    def _without_guarantee(self, report: dict[str, Any]) -> dict[str, Any]:
        """The report of a run without a formal guarantee: no number labelled ε; what may be shown, labelled."""
        figures = dict(self.dp_method.figures_without_guarantee())
        epsilon = report.pop("epsilon", None)
        report.pop("training_epsilon", None)
        if epsilon is not None and math.isfinite(epsilon):  # only a test seed (this run's or an audit's) leaves one
            figures["accounting_with_a_secret_seed"] = {
                "value": epsilon,
                "what": f"What the {report['accountant']} accountant gives for these mechanisms at δ: it would bound "
                        "the privacy loss had all the noise and sampling come from a secret key. Some came from a "
                        "test seed (this run's or a composed audit's), which replays them, so it bounds nothing.",
            }
        if figures:
            report["not_a_guarantee"] = figures
        return report

    def attach_audit(self, result: AuditResult) -> None:
        """Put an audit on the card; one run on the training data (the default) is composed into ε from now on.

        Attaching the same result again changes nothing. An attached audit cannot be removed: its run is spent.
        """
        if not isinstance(result, AuditResult):
            raise TypeError(
                f"attach_audit takes the AuditResult run_audit returned, got {type(result).__name__}: a card entry "
                "alone would leave the audit run's mechanisms out of ε."
            )
        fingerprint = getattr(self.train_dataset, "_fingerprint", None)
        if result.audit_data != "private" and fingerprint is not None and result.dataset_fingerprint == fingerprint:
            raise ValueError(
                f"The audit was declared to run on {result.audit_data} data, but it trained on this trainer's "
                "training set (same fingerprint). Run it with audit_data='private' so it is composed into ε."
            )
        if result in self._audits:
            return
        self._audits.append(result)
        report = self.privacy_report()
        target = self.dp_config.target_epsilon
        if "epsilon" not in report:
            logger.info("Audit attached (%s); this run has no guarantee, so the card reports no ε.", result.declaration)
            return
        if result.audit_data == "private" and target is not None and report["epsilon"] > target:
            logger.warning(
                "The audit ran on the training data, so its run is composed into the guarantee: ε=%.4g (training "
                "alone %.4g) now exceeds the target ε=%.4g.", report["epsilon"], report["training_epsilon"], target,
            )
        logger.info("Audit attached (%s); the card reports ε=%.4g.", result.declaration, report["epsilon"])

    @property
    def audit(self) -> dict[str, Any] | None:
        """The card's `privacy.audit` block: the last attached audit's entry (a lower bound, never the guarantee)."""
        return self._audits[-1].card_entry() if self._audits else None

    @audit.setter
    def audit(self, result: AuditResult) -> None:
        self.attach_audit(result)

    # ------------------------------------------------------------------ evaluation: held out or not
    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                 **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluate, recording its metrics and whether the card may call them held-out.

        Only metrics computed here reach the card, each with the verdict on the very set that produced it (a dict
        of sets recurses here once per set, under the prefix eval_<name>).
        """
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, str):  # Trainer's recursion over a dict names self.eval_dataset's entries
            dataset = self.eval_dataset[dataset]
        if isinstance(dataset, dict) or dataset is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        status = OVERLAPS if self.training_rows.overlap(dataset, metric_key_prefix) else HELD_OUT
        with self._held_out_predictions.counting(held_out=status == HELD_OUT):
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        self._eval_results[metric_key_prefix] = (status, published_metrics(metrics, metric_key_prefix))
        self._held_out_predictions.warn_if_collapsed(metric_key_prefix, self.model, self._run_settings(), reduce=(
            partial(self.accelerator.reduce, reduction="sum") if self.args.world_size > 1 else None))
        return metrics

    def _run_settings(self) -> RunSettings:
        """What a collapse warning names as likely causes."""
        trained, total = self._values_of(self.trained_parameter_names)
        return RunSettings(self.dp_config.max_grad_norm, self.args.learning_rate, self.dataset_size, trained, total,
                           self.training_steps())

    def _trained_fraction(self) -> float:
        """Share of the model's values trained in any phase (what a saved adapter holds)."""
        return self._share_of_model(self.trained_parameter_names)

    def _trainable_fraction(self) -> float:
        """Share of the model's values the current stage trains."""
        return round(self._share_of_model(self.dp_method.trained_parameter_names(self.model)), 6)

    def _share_of_model(self, names: set[str]) -> float:
        named, total = self._values_of(names)
        return named / total

    def _values_of(self, names: set[str]) -> tuple[int, int]:
        """(values of the named tensors, values of the model), training scaffolding (`auxiliary_parameter_names`)
        aside."""
        auxiliary = auxiliary_parameter_names(self.model)
        params = {n: p for n, p in self.model.named_parameters() if n not in auxiliary}
        return sum(params[n].numel() for n in names if n in params), sum(p.numel() for p in params.values())

    # ------------------------------------------------------------------ saving and the card
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            save_privacy_record(output_dir, self.ledger, self.dp_config, self.dp_method.state_dict())
            self._write_card(output_dir)

    @property
    def adapter_format(self) -> str:
        """How save_model stores the result: 'peft', 'private_adapter' (only the trained tensors) or 'full'."""
        return adapter_format(self.model, self.trained_parameter_names)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Checkpoints and final saves alike write only what was trained (see `hf_private.adapters`)."""
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
        self._reloaded_best = reloaded_checkpoint(self.state, self.args.metric_for_best_model, self._eval_results)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs: Any):
        """Trainer's push (transformers 5.x), but only the allow-listed artefacts of `hf_private.artifacts` go up
        (see `hf_private.hub`): Trainer would upload the whole output directory."""
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
        """README.md, built by `hf_private.card_facts` from what this run knows (the keywords: create_model_card's)."""
        write_card(output_dir, self._card_facts(), **publication)

    def _card_facts(self) -> RunFacts:
        return RunFacts(
            report=self.privacy_report(),
            audit=self.audit,
            model=self.model,
            adapter_format=self.adapter_format,
            trained_tensors=len(self.trained_parameter_names),
            trained_fraction=self._trained_fraction(),
            citations=self.dp_method.citations(),
            hub_id=self.args.hub_model_id or getattr(self, "hub_model_id", None),
            planned_steps=self.planned_steps,
            expected_batch_size=self.expected_batch_size,
            learning_rate=self.args.learning_rate,
            optimizer=optimizer_name(self.optimizer),
            evaluations=self._eval_results,
            reloaded_best=getattr(self, "_reloaded_best", None),
            global_step=self.state.global_step,
        )


class PrivateTrainer(PrivateTrainingMixin, Trainer):
    """`Trainer` plus `dp_config`; every other keyword is Trainer's own."""


_PRIVATE_CLASSES: dict[type[Trainer], type[Trainer]] = {Trainer: PrivateTrainer}


def privatize(trainer_class: type[Trainer]) -> type[Trainer]:
    """The private subclass of `trainer_class` (a `transformers.Trainer` subclass): the same class plus `dp_config`.

    Its own metrics, callbacks, evaluation (`predict_with_generate` included) and data collator are kept; what would
    change what is clipped (its own `training_step`, a batch-level `compute_loss` without `per_example_loss`, its own
    sampler or optimizer) is refused when the trainer is built, by name and with the reason.
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


# ---------------------------------------------------------------------- helpers
class _LogicalBatchBoundaries(TrainerCallback):
    """Trainer's hooks around every optimizer step.

    Begin: reset the engine, so an interrupted batch never joins the next. End: stop once the budget allows no
    further step, so the loop ends with global_step equal to the ledger's steps (not one empty step later).
    """

    def __init__(self, trainer: PrivateTrainingMixin) -> None:
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.engine.reset()
        self.trainer._before_step()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer._may_step():
            self.trainer._stop_for_budget()


def _slice(value, size: int, start: int, stop: int):
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == size:
        return value[start:stop]
    return value

