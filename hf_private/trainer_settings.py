"""Which of Trainer's settings PrivateTrainer honours, replaces or refuses — decided at construction.

A Trainer user expects every setting to do what it says. Under DP-SGD some cannot: they would change what is
clipped (a batch-mean loss, clipping the summed gradient), reach data the sampler does not account for, or be
ignored without a word. Each is either supported through the per-example loss, or refused here, before the
Hub repository is created and before any step, with the fix named.
"""

from __future__ import annotations

from typing import Any

from transformers import Seq2SeqTrainer, Trainer, TrainingArguments

from .logs import get_logger

logger = get_logger(__name__)

PER_EXAMPLE_LOSS_HINT = (
    "Pass PrivateTrainer(per_example_loss=fn) with fn(model, outputs, labels) returning one loss per example "
    "(shape [B]); see 'Custom losses' in the README."
)
# report_to integrations that write only to this machine; every other one may send the logs elsewhere.
_LOCAL_LOGGERS = ("none", "tensorboard", "codecarbon")
# Trainer methods a class privatize() wraps (or a subclass of the private class) must not override: the private
# training path runs in them. compute_loss may be overridden for evaluation when per_example_loss gives the training
# loss.
_PRIVATE_PATH_METHODS = {
    "training_step": "it runs forward/backward in physical chunks with each example's gradient clipped",
    "get_train_dataloader": "it draws the Poisson batches the accountant assumes",
    "_get_train_sampler": "the Poisson batch sampler replaces Trainer's sampler",
    "create_optimizer": "its optimizer wrapper adds the noise once per logical batch",
    "floating_point_ops": "Trainer's count is an exact function of each batch's private token count",
}


def check_subclass(trainer_class: type[Trainer], mixin: type, custom_loss: bool) -> None:
    """Refuse a trainer class whose own methods would replace or bypass the private training path: the classes it
    derives from between the mixin and Trainer (what privatize() wrapped), and any subclass of the private class."""
    for cls in trainer_class.__mro__:
        if cls in (mixin, Trainer, object) or not issubclass(cls, Trainer):
            continue
        for name, reason in _PRIVATE_PATH_METHODS.items():
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} overrides {name}(), which private training needs: {reason}. Remove the "
                    "override (evaluation, metrics, callbacks and the data collator may be customised freely)."
                )
        if "compute_loss" in cls.__dict__ and not custom_loss:
            raise TypeError(
                f"{cls.__name__} overrides compute_loss(), which private training replaces by a per-example loss: a "
                "batch-mean loss shrinks every example's signal by the batch size against the noise and couples "
                f"examples through its normaliser. {PER_EXAMPLE_LOSS_HINT} Your compute_loss then serves evaluation "
                "only."
            )


def check_trainer_kwargs(kwargs: dict[str, Any]) -> None:
    """Trainer keywords that cannot be honoured under DP-SGD."""
    if kwargs.get("compute_loss_func") is not None:
        raise ValueError(
            "compute_loss_func is not supported: Trainer calls it with the whole batch and expects one reduced loss, "
            f"so per-example clipping cannot see each example's loss. {PER_EXAMPLE_LOSS_HINT}"
        )
    optimizer, scheduler = kwargs.get("optimizers") or (None, None)
    if optimizer is not None or scheduler is not None:
        raise ValueError(
            "optimizers=(optimizer, scheduler) is not supported: PrivateTrainer builds the optimizer itself, around "
            "a wrapper that adds the noise. Pass optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) and choose the "
            "schedule with TrainingArguments(lr_scheduler_type=..., warmup_steps=...)."
        )
    if kwargs.get("model_init") is not None:
        raise ValueError("model_init (hyperparameter search) is not supported: pass the model itself.")


def check_training_args(args: TrainingArguments, max_grad_norm: float, custom_loss: bool,
                        trainer_class: type[Trainer] = Trainer) -> None:
    """Refuse what cannot be honoured; replace Trainer's gradient clipping by the per-example clip, saying so."""
    if args.fp16:
        raise ValueError("fp16 with a GradScaler rescales gradients before clipping; use bf16=True or fp32.")
    if args.activation_checkpointing or args.gradient_checkpointing:
        raise ValueError("Activation checkpointing re-runs forward hooks and is not supported yet; turn it off.")
    if args.torch_compile:  # also set by torch_compile_backend or torch_compile_mode
        raise ValueError(
            "torch_compile=True is not supported: the hooks that compute and clip each example's gradient register "
            "on the forward pass and flip requires_grad while a chunk is recorded, which a compiled graph does not "
            "allow (it fails after compiling, with an unrelated 'modified in place' error). Set torch_compile=False."
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "group_by_length"):
        raise ValueError(
            f"train_sampling_strategy={strategy!r} is not supported: the privacy guarantee assumes every logical "
            "batch is a Poisson sample (each example kept independently with probability q), which PrivateTrainer "
            "draws itself. Use 'random' (Poisson batches) or 'group_by_length' (the same Poisson batches, each "
            "ordered by length before it is split into chunks, so chunks pad less)."
        )
    if getattr(args, "predict_with_generate", False) and not issubclass(trainer_class, Seq2SeqTrainer):
        raise ValueError(
            f"predict_with_generate is a Seq2SeqTrainer setting that {trainer_class.__name__} would ignore: "
            "evaluation would report teacher-forced logits, not generations. Use privatize(Seq2SeqTrainer), or set "
            "predict_with_generate=False and call model.generate() on your evaluation data after training."
        )
    if args.label_smoothing_factor and custom_loss:
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor} is applied by the default per-example loss only; "
            "with your own per_example_loss, smooth the labels inside it (e.g. F.cross_entropy(..., "
            "label_smoothing=...)) and leave label_smoothing_factor at 0."
        )
    _replace_trainer_clipping(args, max_grad_norm)
    _warn_remote_logging(args)


def _warn_remote_logging(args: TrainingArguments) -> None:
    """The training loss is an un-noised function of the private data; an integration may carry it off the machine."""
    remote = [name for name in (args.report_to or []) if name not in _LOCAL_LOGGERS]
    if remote:
        logger.warning(
            "report_to=%s receives every log line, including the training loss, which is computed on the private "
            "data without noise and is not covered by the privacy guarantee; a hosted service keeps it outside this "
            "machine. Use report_to='tensorboard' or 'none', or keep those runs private.", remote,
        )


def _replace_trainer_clipping(args: TrainingArguments, max_grad_norm: float) -> None:
    """Trainer clips the summed gradient (not DP); the per-example clip norm C of the DP config is used instead."""
    value = args.max_grad_norm
    if not value:
        return
    default = TrainingArguments.__dataclass_fields__["max_grad_norm"].default
    if value not in (default, max_grad_norm):
        logger.warning(
            "TrainingArguments.max_grad_norm=%g is not used: PrivateTrainer clips each example's gradient to the DP "
            "config's max_grad_norm C=%g instead (clipping the summed gradient is not private). To clip at %g, pass "
            "it to the DP config (e.g. DPConfig(max_grad_norm=%g)).", value, max_grad_norm, value, value,
        )
    else:
        logger.info("Trainer's clipping of the summed gradient is off; each example is clipped to C=%g.",
                    max_grad_norm)
    args.max_grad_norm = 0.0
