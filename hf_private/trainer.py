"""`PrivateTrainer`: a `transformers.Trainer` whose every update is differentially private.

Wiring (see DESIGN.md): Poisson batch sampler → physical chunks → engine hooks clip per example during the one
backward pass → `NoisyOptimizer.step` adds noise once per logical batch → ledger records the step. The model
stays the user's own `PreTrainedModel`/`PeftModel`, so saving, evaluation and `push_to_hub` work as usual.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import get_last_checkpoint

from .adapters import (
    ADAPTER_WEIGHTS_NAME,
    adapter_format,
    has_private_adapter,
    load_adapter_weights,
    save_private_adapter,
    unwrap_peft,
)
from .engine import PerExampleGradientEngine
from .losses import PerExampleLoss, default_per_example_loss
from .methods import DPConfig
from .methods.dpsgd.config import CONFIG_NAME as DP_CONFIG_NAME
from .model_card import adapter_note, build_model_card, load_snippet, privacy_metadata, write_model_card
from .optimizer import NoisyOptimizer
from .privacy import (
    GaussianNoise,
    PrivacyLedger,
    calibrate_noise_multiplier,
    SecretRandom,
    max_steps_within,
)
from .sampling import EmptySafeCollator, PoissonBatchSampler, batch_size_of, expected_steps_per_epoch

logger = logging.getLogger(__name__)

LEDGER_NAME = "privacy_ledger.json"
_SUPPORTED_PARALLELISM = (
    "hf_private supports one process per device (DDP through `accelerate launch --multi_gpu --num_processes N`, "
    "or torchrun), each holding the whole model."
)
_NON_METRIC_EVAL_KEYS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


class PrivateTrainer(Trainer):
    """`Trainer` plus `dp_config`; every other keyword is Trainer's own."""

    loss_is_scaled_for_ga = True  # our loss is a per-example sum; Trainer must not rescale it

    def __init__(
        self,
        model: nn.Module | None = None,
        args=None,
        *trainer_args: Any,
        dp_config: DPConfig,
        per_example_loss: PerExampleLoss | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if not isinstance(dp_config, DPConfig):
            raise TypeError(f"dp_config must be a DPConfig (or a method config), got {type(dp_config).__name__}.")
        if model is None:
            raise ValueError("PrivateTrainer needs a model; model_init (hyperparameter search) is not supported.")
        _check_model(model)
        dp_config.prepare_model(model)
        train_dataset = trainer_kwargs.get("train_dataset", trainer_args[1] if len(trainer_args) > 1 else None)
        self.dataset_size = _dataset_size(train_dataset)  # before Trainer, whose own errors are less specific
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self.dp_config = dp_config
        self.per_example_loss = per_example_loss or default_per_example_loss
        self._check_setup()
        self.delta = dp_config.resolve_delta(self.dataset_size)
        world = self.args.world_size
        self.expected_batch_size = (
            self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * world
        )
        if self.expected_batch_size > self.dataset_size:
            raise ValueError(
                f"Expected logical batch {self.expected_batch_size} (per_device_train_batch_size × "
                f"gradient_accumulation_steps × world_size) exceeds the dataset size {self.dataset_size}."
            )
        self.sample_rate = self.expected_batch_size / self.dataset_size
        self.steps_per_epoch = expected_steps_per_epoch(self.sample_rate)
        self.planned_steps = (
            self.args.max_steps
            if self.args.max_steps > 0
            else math.ceil(self.args.num_train_epochs * self.steps_per_epoch)
        )
        self.noise_multiplier = self._noise_multiplier()
        self.ledger = PrivacyLedger(self.dataset_size, self.delta, dp_config.accountant)
        self.phases = dp_config.phases()
        self.phase = 0
        self.phase_switch_steps = [round(epochs * self.steps_per_epoch) for _, epochs in self.phases[:-1]]
        self.engine = PerExampleGradientEngine(self.model, dp_config.max_grad_norm)
        self.engine.attach()
        # Every tensor trainable in any phase: what a saved adapter must contain.
        self.trained_parameter_names = {name for name, p in self.model.named_parameters() if p.requires_grad}
        self._step_limit: int | None = None
        self._budget_exhausted = False
        self.audit: dict[str, Any] | None = None  # `AuditResult.card_entry()`: a lower bound, never the guarantee
        logger.info(
            "DP-SGD plan: N=%d, q=%.5g, %d steps, σ=%.4g, C=%g, δ=%.3g, accountant=%s.",
            self.dataset_size, self.sample_rate, self.planned_steps, self.noise_multiplier,
            dp_config.max_grad_norm, self.delta, dp_config.accountant,
        )

    # ------------------------------------------------------------------ validation and plan
    def _check_setup(self) -> None:
        args = self.args
        if args.max_grad_norm and args.max_grad_norm > 0:
            logger.info(
                "Setting TrainingArguments.max_grad_norm=0 (was %s): clipping the summed gradient is not DP; "
                "the per-example clip is dp_config.max_grad_norm.", args.max_grad_norm,
            )
            args.max_grad_norm = 0.0
        if args.fp16:
            raise ValueError("fp16 with a GradScaler rescales gradients before clipping; use bf16=True or fp32.")
        if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
            raise ValueError("Activation checkpointing re-runs forward hooks and is not supported yet; turn it off.")
        if args.n_gpu > 1:
            raise ValueError(
                f"torch DataParallel (several GPUs in one process) is not supported: {_SUPPORTED_PARALLELISM}"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "DeepSpeed and FSDP shard gradients before a flat per-example clip is possible: "
                + _SUPPORTED_PARALLELISM
            )
        if self.is_model_parallel or self.is_distributed_loading_by_transformers:  # Trainer's own reading
            raise ValueError("Model or tensor parallelism (one model split over several devices) is not supported: "
                             + _SUPPORTED_PARALLELISM)

    def _noise_multiplier(self) -> float:
        if self.dp_config.noise_multiplier is not None:
            return float(self.dp_config.noise_multiplier)
        return calibrate_noise_multiplier(
            self.dp_config.target_epsilon, self.delta, self.sample_rate, self.planned_steps,
            accountant=self.dp_config.accountant, name=self.dp_config.phases()[0][0],
        )

    @property
    def mechanism_name(self) -> str:
        return self.phases[self.phase][0]

    def _maybe_start_next_phase(self) -> None:
        """Between logical batches: switch to the next phase's trainable set once its step is reached."""
        if self.phase >= len(self.phase_switch_steps) or self.ledger.total_steps < self.phase_switch_steps[self.phase]:
            return
        self.phase += 1
        self.dp_config.select_phase_two(self.model)
        self.trained_parameter_names |= {name for name, p in self.model.named_parameters() if p.requires_grad}
        self.engine.detach()
        self.engine = PerExampleGradientEngine(self.model, self.dp_config.max_grad_norm)
        self.engine.attach()
        noisy = self.optimizer
        while not isinstance(noisy, NoisyOptimizer):
            noisy = noisy.optimizer
        noisy.engine = self.engine  # the optimizer keeps every phase's parameters; untouched ones get no grad
        logger.info("Phase %d (%s) starts after %d steps: %d trainable tensors.", self.phase + 1,
                    self.mechanism_name, self.ledger.total_steps, len(self.engine.parameters))

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """A plain DataLoader with a Poisson batch sampler (not passed through Accelerate: it would re-shard)."""
        dataset = self.train_dataset
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        # Secret mode: an independent OS-seeded generator per rank. Test mode: one seed on every rank, so a
        # multi-process run draws the very logical batch a single process would (each rank keeps its shard).
        seed = self.dp_config.noise_seed
        random = SecretRandom(test_seed=None if seed is None else seed + 7919)
        sampler = PoissonBatchSampler(
            len(dataset), self.sample_rate, self.steps_per_epoch, self.args.gradient_accumulation_steps,
            rank=self.args.process_index, world_size=self.args.world_size, random=random,
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=EmptySafeCollator(self.data_collator, dataset[0]),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    # ------------------------------------------------------------------ optimisation
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        for current in (self.optimizer, getattr(self.optimizer, "optimizer", None)):  # maybe AcceleratedOptimizer
            if isinstance(current, NoisyOptimizer):
                self.optimizer = current
                return current
        if self.optimizer is not None:
            raise ValueError(
                "PrivateTrainer builds its own optimizer wrapper; pass the optimizer class through "
                "optimizer_cls_and_kwargs instead of an instance in optimizers=(...)."
            )
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
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if "labels" not in inputs:
            raise ValueError(f"Training batches need a 'labels' entry; got keys {sorted(inputs)}.")
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = self.per_example_loss(model, outputs, labels).sum()
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward/backward in physical chunks of at most per_device_train_batch_size, each clipped per example."""
        zero = torch.zeros((), device=self.args.device)
        self._maybe_start_next_phase()
        if not self._may_step():
            self._stop_for_budget()
            return zero
        size = batch_size_of(inputs)
        # The unwrapped model: DDP must not all-reduce un-clipped gradients (the optimizer reduces clipped sums).
        model = self.accelerator.unwrap_model(model)
        chunk = self.args.per_device_train_batch_size
        total = zero
        for start in range(0, size, chunk):
            part = {k: _slice(v, size, start, start + chunk) for k, v in inputs.items()}
            with self.engine.recording(min(chunk, size - start)):
                total = total + super().training_step(model, part, None)
            self.engine.finish_backward()
        return total / (self.expected_batch_size / self.args.world_size)

    def _may_step(self) -> bool:
        return self._step_limit is None or self.ledger.total_steps < self._step_limit

    def _record_step(self) -> None:
        self.ledger.record(self.mechanism_name, self.noise_multiplier, self.sample_rate, self.dp_config.max_grad_norm)

    def _stop_for_budget(self) -> None:
        if not self._budget_exhausted:
            logger.warning(
                "Privacy budget reached: ε=%.4g of target %.4g after %d steps. Stopping training so the budget is "
                "not exceeded.", self.ledger.epsilon(), self.dp_config.target_epsilon, self.ledger.total_steps,
            )
        self._budget_exhausted = True
        self.control.should_training_stop = True

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint:
            checkpoint = (
                get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
            )
            if checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from.")
            self._load_ledger(checkpoint)
            resume_from_checkpoint = checkpoint
        if self.dp_config.target_epsilon is not None:
            self._step_limit = self.ledger.total_steps + max_steps_within(
                self.dp_config.target_epsilon, self.delta, self.noise_multiplier, self.sample_rate,
                accountant=self.dp_config.accountant, prior=self.ledger.mechanisms, name=self.mechanism_name,
            )
        self._budget_exhausted = not self._may_step()
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        report = self.privacy_report()
        output.metrics.update(epsilon=report["epsilon"], delta=report["delta"])
        logger.info("Trained privately: ε=%.4g, δ=%.3g (%s) after %d steps.", report["epsilon"], report["delta"],
                    report["accountant"], report["steps"])
        return output

    def _load_ledger(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, LEDGER_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {LEDGER_NAME}: resuming from it would lose the privacy already spent. "
                "Resume only from checkpoints written by PrivateTrainer."
            )
        ledger = PrivacyLedger.load(path)
        if (ledger.dataset_size, ledger.delta, ledger.accountant) != (self.dataset_size, self.delta,
                                                                        self.dp_config.accountant):
            raise ValueError(
                f"Checkpoint ledger (N={ledger.dataset_size}, δ={ledger.delta}, {ledger.accountant}) does not match "
                f"this run (N={self.dataset_size}, δ={self.delta}, {self.dp_config.accountant})."
            )
        self.ledger = ledger

    # ------------------------------------------------------------------ reporting
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.pop("grad_norm", None)  # a norm of un-clipped, un-noised gradients: not private
        if "loss" in logs or "train_loss" in logs:
            logs["epsilon"] = self.ledger.epsilon()
        super().log(logs, start_time)

    def privacy_report(self) -> dict[str, Any]:
        report = self.ledger.report()
        if self.dp_config.noise_seed is None:
            report.update(guarantee="formal")
        else:
            report.update(guarantee="none", guarantee_note=(
                "Trained in insecure test mode (DPConfig.noise_seed is set): the noise and sampling can be "
                "replayed by anyone who knows the seed, so the ε below holds only against those who do not."
            ))
        report.update(
            method=self.dp_config.method,
            unit="example",
            target_epsilon=self.dp_config.target_epsilon,
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            max_grad_norm=self.dp_config.max_grad_norm,
            planned_steps=self.planned_steps,
            expected_batch_size=self.expected_batch_size,
            trainable_fraction=self._trainable_fraction(),
            phases=[{"mechanism": name, "from_step": start} for (name, _), start
                    in zip(self.phases, [0, *self.phase_switch_steps])],
        )
        return report

    def _trained_fraction(self) -> float:
        """Share of the model's values trained in any phase (what a saved adapter holds)."""
        params = dict(self.model.named_parameters())
        trained = sum(params[n].numel() for n in self.trained_parameter_names if n in params)
        return trained / sum(p.numel() for p in params.values())

    def _trainable_fraction(self) -> float:
        trainable = sum(p.numel() for _, p in self.engine.parameters)
        return round(trainable / sum(p.numel() for p in self.model.parameters()), 6)

    # ------------------------------------------------------------------ saving and the card
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            self.ledger.save(os.path.join(output_dir, LEDGER_NAME))
            self.dp_config.save_pretrained(output_dir)
            self._write_card(output_dir)

    @property
    def adapter_format(self) -> str:
        """How save_model stores the result: 'peft', 'private_adapter' (only the trained tensors) or 'full'."""
        return adapter_format(self.model, self.trained_parameter_names)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Checkpoints and final saves alike write only what was trained (see `hf_private.adapters`)."""
        if self.adapter_format != "private_adapter":
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        save_private_adapter(self.model, output_dir, self.trained_parameter_names)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

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
            return
        super()._load_best_model()

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer copies only transformers/PEFT weight files; the adapter, ledger and card must travel together."""
        busy = (not self.args.hub_always_push and self.push_in_progress is not None
                and not self.push_in_progress.is_done())
        if self.is_world_process_zero() and self.args.hub_strategy != "end" and not busy:
            for name in (ADAPTER_WEIGHTS_NAME, DP_CONFIG_NAME, LEDGER_NAME, "README.md"):
                source = os.path.join(checkpoint_folder, name)
                if os.path.isfile(source):
                    shutil.copy(source, os.path.join(self.args.output_dir, name))
        super()._push_from_checkpoint(checkpoint_folder)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
        if self.is_world_process_zero():
            self._write_card(self.args.output_dir, model_name=model_name, finetuned_from=finetuned_from,
                             tags=[tags] if isinstance(tags, str) else tags, dataset=dataset)

    def _inner_optimizer_name(self) -> str:
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer"):  # AcceleratedOptimizer → NoisyOptimizer → the real one
            optimizer = optimizer.optimizer
        return type(optimizer).__name__

    def _write_card(self, output_dir: str, model_name=None, finetuned_from=None, tags=None, dataset=None) -> None:
        report = self.privacy_report()
        fmt = self.adapter_format
        base = unwrap_peft(self.model)
        base_model = finetuned_from or _base_model_name(base)
        repo = self.args.hub_model_id or model_name or os.path.basename(os.path.abspath(self.args.output_dir))
        training = {
            "method": report["method"],
            "dataset": dataset or "private training data (not published)",
            "steps taken": report["steps"],
            "planned steps": self.planned_steps,
            "expected logical batch size (q·N)": self.expected_batch_size,
            "learning rate": self.args.learning_rate,
            "optimizer": self._inner_optimizer_name(),
            "trainable parameters": f"{100 * report['trainable_fraction']:.3f}% of the model",
        }
        card = build_model_card(
            privacy=privacy_metadata(report, report["method"], audit=self.audit),
            base_model=base_model,
            model_title=model_name or repo,
            training=training,
            eval_results=_held_out_metrics(self.state.log_history),
            load_snippet=load_snippet(fmt, type(base).__name__, base_model, repo, _num_labels(base)),
            library_name="peft" if fmt == "peft" else "transformers",
            tags=tags,
            citations=self.dp_config.citations(),
            adapter_note=adapter_note(fmt, len(self.trained_parameter_names), self._trained_fraction()),
            needs_hf_private=fmt == "private_adapter",
        )
        write_model_card(card, output_dir)


# ---------------------------------------------------------------------- helpers
def _check_model(model: nn.Module) -> None:
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError(
            f"Pass the model itself, not a {type(model).__name__} wrapper: Trainer wraps it for DDP and "
            f"PrivateTrainer reduces the clipped gradients itself. {_SUPPORTED_PARALLELISM}"
        )
    batch_norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        raise ValueError(
            f"BatchNorm layers {batch_norms} mix examples in train mode, which breaks per-example clipping and "
            "the guarantee. Replace them with GroupNorm/LayerNorm (opacus.validators.ModuleValidator.fix)."
        )


def _dataset_size(dataset) -> int:
    if dataset is None:
        raise ValueError("PrivateTrainer needs train_dataset: its size N sets the sampling rate and δ.")
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "IterableDataset has no known size, so Poisson sampling and accounting are impossible; "
            "materialise it (e.g. datasets.Dataset.from_generator) first."
        )
    size = len(dataset)
    if size == 0:
        raise ValueError("train_dataset is empty.")
    return size


def _slice(value, size: int, start: int, stop: int):
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == size:
        return value[start:stop]
    return value


def _base_model_name(base: nn.Module) -> str | None:
    """The pre-trained model's Hub id or path; None for a model built from config."""
    name = getattr(getattr(base, "config", None), "_name_or_path", "") or ""
    return name if name and " " not in name else None


def _held_out_metrics(log_history: list[dict]) -> dict[str, float]:
    evals = [e for e in log_history if any(k.startswith("eval_") for k in e)]
    if not evals:
        return {}
    last = evals[-1]
    return {k: round(v, 4) for k, v in last.items() if k.startswith("eval_") and k not in _NON_METRIC_EVAL_KEYS}


def _num_labels(model: nn.Module) -> int | None:
    """Needed to rebuild a new classification head's shape on the base model; None for other heads."""
    if type(model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification")):
        return getattr(getattr(model, "config", None), "num_labels", None)
    return None
