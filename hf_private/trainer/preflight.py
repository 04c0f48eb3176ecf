"""Every refusal made when a private trainer is built, in one place, grouped by what it checks.

A Trainer user expects every setting to do what it says. Under DP-SGD some cannot: they would change what is
clipped (a batch-mean loss, clipping the summed gradient), reach data the sampler does not account for, publish
un-noised functions of the private data, or be ignored without a word. Each is either supported through the
per-example loss, or refused here, with the fix named.

Why before `Trainer.__init__` (`check_before_trainer`):

* `Trainer.__init__` creates the Hub repository when `push_to_hub` is set: a refused run must not leave one behind;
* a refused run must leave the user's model untouched: the DP method wraps the model and chooses what trains
  (`wrap_model`, `prepare_model`) only after every check has passed;
* Trainer's own errors on the same input are less specific (no `train_dataset`, an `IterableDataset`), and refusing
  spends no privacy: nothing has been sampled yet.

What needs the built Trainer is checked right after it, before anything is planned (`check_built_trainer`): the
default TrainingArguments Trainer makes when `args` is None, the parallelism its accelerator set up (several GPUs in
one process, DeepSpeed, FSDP1, a model split over devices), the process count and the expected logical batch.

The rules on the privacy numbers themselves (exactly one of target_epsilon and noise_multiplier, δ, the expected
batch against N) are the plan's (`privacy.plan`): a DP config and a standalone `PrivacyPlan` apply them too, so they
are written there once and called from here. Facts computed over the inputs (label counts over Arrow columns) are
computed where they live; the decisions are taken here.

The settings checks also normalise or warn where nothing is refused: Trainer's clipping of the summed gradient is
turned off with a note, a logging integration that may carry the training loss off the machine is named, and a launch
with fewer processes than asked says so.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.utils.data import IterableDataset
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments
from transformers.trainer_utils import HubStrategy

from ..data import chunks
from ..data.labels import LabelCounts, check_collated_labels, count_labels, refuse_string_labels
from ..data.units import PrivacyUnits
from ..data.users import UserIndex, capped_size
from ..integrations import TrainerFamily, family_of
from ..logs import get_logger
from ..methods import MethodConfig
from ..privacy.plan import check_expected_batch
from ..release.artifacts import DP_CONFIG_NAME, LEDGER_NAME
from .sharded import check_sharded_mesh, check_sharding

logger = get_logger(__name__)


# ---------------------------------------------------------------------- the two calls the trainer makes
@dataclass(frozen=True)
class Preflight:
    """What the checks before Trainer found and later code needs."""

    dataset_size: int  # N: sets the sampling rate and δ
    delta: float  # δ of the guarantee, resolved for N
    labels: LabelCounts  # non-finite and -100 labels; the -100 count is logged with the plan
    family: TrainerFamily  # the trainer class's family (hf_private.integrations): its unit, rows and per-unit loss
    unit: str  # the privacy unit, as the family names the training set's rows ("user" at user level)
    model: nn.Module  # the model as given, checked: never None
    users: UserIndex | None = None  # at user level: the users of the training set as it was given


def check_before_trainer(
    trainer_class: type[Trainer],
    mixin: type,
    model: nn.Module | None,
    args: TrainingArguments | None,
    dp_config: MethodConfig,
    per_example_loss: Any,
    train_dataset: Any,
    trainer_kwargs: dict[str, Any],
) -> Preflight:
    """Every refusal that needs no built Trainer, before it creates the Hub repo and before the model is touched."""
    custom_loss = per_example_loss is not None
    family = family_of(trainer_class)
    check_dp_config(dp_config)
    check_user_level_method(dp_config)
    check_subclass(trainer_class, mixin, custom_loss, family)
    check_custom_loss(custom_loss, family)
    check_trainer_kwargs(trainer_kwargs, family, dp_config)
    model = check_model(model)
    dataset_size = check_dataset(train_dataset)
    family.check_columns(train_dataset, args, trainer_kwargs)  # what the family's trainer prepares from (TRL)
    users = None
    if dp_config.privacy_unit == "user":  # ULS: N counts users (q = B / users); ELS: the examples users keep
        assert dp_config.user_column is not None  # `users.check_privacy_unit`: the user level names its column
        users = UserIndex.of(train_dataset, dp_config.user_column)
        if dp_config.user_sampling == "user":
            dataset_size = users.users
        else:
            assert dp_config.max_examples_per_user is not None  # `users.check_privacy_unit`: ELS caps every user
            dataset_size = capped_size(users, dp_config.max_examples_per_user)
        unit = "user"
    else:
        unit = family.unit(train_dataset)
    refuse_string_labels(train_dataset, model)
    labels = check_labels(train_dataset)  # one pass: refuse non-finite labels now, log the -100 count later
    if args is not None:  # else Trainer makes default arguments: check_built_trainer checks them
        check_arguments(args, dp_config.initial_clip_norm, custom_loss, trainer_class, family, model)
        check_user_level_arguments(args, dp_config)
        check_sharding(args, model, dp_config)  # before Trainer, which refuses FSDP on one process
    return Preflight(dataset_size, dp_config.resolve_delta(dataset_size), labels, family, unit, model, users)


def check_built_trainer(
    trainer: Trainer, args_given: bool, dp_config: MethodConfig, per_example_loss: Any, checked: Preflight
) -> int:
    """What needs the built Trainer (its default arguments, its accelerator's parallelism, the world size); returns
    the expected logical batch (per_device_train_batch_size × gradient_accumulation_steps × world_size)."""
    if not args_given:
        assert trainer.model is not None  # check_before_trainer refused a missing model and model_init
        check_arguments(
            trainer.args,
            dp_config.initial_clip_norm,
            per_example_loss is not None,
            type(trainer),
            checked.family,
            trainer.model,
        )
        check_user_level_arguments(trainer.args, dp_config)
    check_parallelism(trainer)
    check_collated_labels(trainer, checked.family.labels_entry)  # labels as the first training batch carries them
    args = trainer.args
    check_process_count(args.world_size)
    expected_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    check_expected_batch(expected_batch_size, checked.dataset_size)
    return expected_batch_size


# ---------------------------------------------------------------------- trainer class and keywords
PER_EXAMPLE_LOSS_HINT = (
    "Pass PrivateTrainer(per_example_loss=fn) with fn(model, outputs, labels) returning one loss per example "
    "(shape [B]); see docs/guides/custom-losses.md."
)
# Methods on the private training path that no class of the trainer's MRO may define but the mixin, Trainer and,
# where its family declares the override compatible (`compatible_overrides`), a family's own class (TRL's SFTTrainer):
# not the class privatize() wrapped, a subclass of the private class, nor a plain mixin placed anywhere among them.
# compute_loss may be defined for evaluation when per_example_loss gives the training loss: training never calls it.
_PRIVATE_PATH_METHODS = {
    "training_step": "it runs forward/backward in physical chunks with each example's gradient clipped",
    "get_train_dataloader": "it draws the Poisson batches the accountant assumes",
    "_get_train_sampler": "the Poisson batch sampler replaces Trainer's sampler",
    "create_optimizer": "its optimizer wrapper adds the noise once per logical batch",
    "floating_point_ops": "Trainer's count is an exact function of each batch's private token count",
    # the mixin's own steps of that path
    "training_data": "it gives the Poisson sampler the training set and, at user level, the users it draws",
    "poisson_chunks": "it draws a method's own Poisson samples (DP-FROST's selection)",
    "record_chunks": "it runs each chunk's forward/backward with each unit's gradient clipped",
    "_chunk_step": "it runs one chunk's forward/backward on the private training loss",
    "_training_loss": "it is the one loss that trains and that the independence probe tests",
    "summed_loss": "it is the one loss that trains and that the independence probe tests",
    "_probe_example_independence": "it checks that no unit's gradient depends on the units beside it",
}
# The privacy unit's steps of that path: methods of the `hf_private.data.units.PrivacyUnits` the trainer holds as
# `units`, refused when patched on that object or its class after the trainer was built.
_PRIVATE_UNIT_METHODS = {
    "training_view": "it is the set the Poisson sampler draws from (at user level: tagged by user, or capped)",
    "poisson_sampler": "it builds the Poisson sampler of the privacy unit at the accounted rate",
    "poisson_sample": "it draws a method's own Poisson samples (DP-FROST's selection) in chunks of whole units",
    "unit_sizes": "it groups a Poisson sample's examples into units, each clipped as one",
    "chunk_lengths": "it orders each Poisson batch by length before it is cut into chunks",
    "in_unit_order": "it keeps a unit's examples together in the independence probe",
}
# The chunk layout of that path: functions of `hf_private.data.chunks` the trainer calls through the module.
_PRIVATE_CHUNK_FUNCTIONS = {
    "physical_chunks": "it cuts each Poisson chunk into physical chunks of whole units, each clipped as one",
    "unit_sizes_of": "it reads how many examples each unit of a collated batch has",
}
_BATCH_LOSS = (
    "a batch-mean loss shrinks every example's signal by the batch size against the noise, and a "
    "batch-level loss (a normaliser, hard-example mining) couples examples"
)


def check_dp_config(dp_config: Any) -> None:
    if not isinstance(dp_config, MethodConfig):
        raise TypeError(f"dp_config must be a DPConfig (or a method config), got {type(dp_config).__name__}.")


def check_subclass(trainer_class: type[Trainer], mixin: type, custom_loss: bool, family: TrainerFamily) -> None:
    """Refuse a trainer class whose own methods would replace or bypass the private training path: every class of its
    MRO is checked (`_checked_classes`), whatever its base, so a plain mixin placed before the private class is too.
    The family's own classes (TRL's SFTTrainer) may override what the family declares compatible, and their
    compute_loss then serves evaluation: the family gives the per-unit training loss."""
    for cls in _checked_classes(trainer_class, mixin):
        compatible = family.compatible_overrides if family.owns(cls) else {}
        for name, reason in _PRIVATE_PATH_METHODS.items():
            if name in cls.__dict__ and name not in compatible:
                raise TypeError(
                    f"{cls.__name__} overrides {name}(), which private training needs: {reason}. Remove the "
                    "override (evaluation, metrics, callbacks and the data collator may be customised freely)."
                )
        if "compute_loss" in cls.__dict__ and not custom_loss and "compute_loss" not in compatible:
            raise TypeError(
                f"{cls.__name__} overrides compute_loss(), which private training replaces by a per-example loss: "
                f"{_BATCH_LOSS}. {PER_EXAMPLE_LOSS_HINT} "
                "Your compute_loss then serves evaluation only: training never calls it."
            )


def _checked_classes(trainer_class: type[Trainer], mixin: type) -> list[type]:
    """Every class of the MRO but the private mixin, Trainer and object: a user's mixin that is not a Trainer is
    checked like a Trainer subclass, since its methods come before Trainer's."""
    return [cls for cls in trainer_class.__mro__ if cls not in (mixin, Trainer, object)]


class HoldsPrivacyUnits(Protocol):
    """A built private trainer as the private-path guard reads it: besides its class, the privacy unit it holds."""

    units: PrivacyUnits


def private_path_functions(trainer: HoldsPrivacyUnits, custom_loss: bool) -> dict[str, Any]:
    """What each function of the private path resolves to on the built trainer: its class's private-path methods
    (compute_loss too without per_example_loss), its privacy unit's (`units.<name>`) and the chunk layout's
    (`chunks.<name>`), once none is found set on an instance (a user's __init__ may set one): recorded when the
    trainer is built, compared by `check_private_path_unchanged` before training and before every step."""
    names = [*_PRIVATE_PATH_METHODS, *([] if custom_loss else ["compute_loss"])]
    functions = {name: inspect.getattr_static(type(trainer), name, None) for name in names}
    functions |= {
        f"units.{name}": inspect.getattr_static(type(trainer.units), name, None) for name in _PRIVATE_UNIT_METHODS
    }
    functions |= {f"chunks.{name}": getattr(chunks, name) for name in _PRIVATE_CHUNK_FUNCTIONS}
    check_private_path_unchanged(trainer, functions)
    return functions


def check_private_path_unchanged(trainer: HoldsPrivacyUnits, functions: dict[str, Any]) -> None:
    """Refuse a private-path function patched since the trainer was built (`functions`: what each resolved to then):
    a method set on the trainer or its privacy unit, or on a class of their MRO, or a chunk function replaced in its
    module; the refusal names the function, where the patch sits and what it is."""
    for name, function in functions.items():
        patch = _patch(trainer, name, function)
        if patch is None:
            continue
        where, now = patch
        reason = _PRIVATE_PATH_REASONS.get(name, f"private training replaces it by a per-example loss: {_BATCH_LOSS}")
        fix = PER_EXAMPLE_LOSS_HINT if name == "compute_loss" else "Remove the patch."
        raise TypeError(
            f"{name}() is patched on {where} (now {_described(now)}), after {type(trainer).__name__} was checked: "
            f"private training needs its own {name}(), since {reason}. {fix}"
        )


_PRIVATE_PATH_REASONS = {
    **_PRIVATE_PATH_METHODS,
    **{f"units.{name}": reason for name, reason in _PRIVATE_UNIT_METHODS.items()},
    **{f"chunks.{name}": reason for name, reason in _PRIVATE_CHUNK_FUNCTIONS.items()},
}


def _patch(trainer: HoldsPrivacyUnits, name: str, recorded: Any) -> tuple[str, Any] | None:
    """(where the private-path function `name` is patched, what it is now), or None while it is as `recorded`."""
    holder, _, attribute = name.rpartition(".")
    if holder == "chunks":
        now = getattr(chunks, attribute)
        return None if now is recorded else (f"module {chunks.__name__}", now)
    owner, described = (trainer.units, "privacy unit") if holder == "units" else (trainer, "trainer")
    if attribute in vars(owner):
        return f"the {described} instance", vars(owner)[attribute]
    cls = type(owner)
    now = inspect.getattr_static(cls, attribute, None)
    if now is recorded:
        return None
    return f"class {next((c for c in cls.__mro__ if attribute in vars(c)), cls).__qualname__}", now


def _described(function: Any) -> str:
    function = getattr(function, "__func__", function)  # a bound method: the function it binds
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', None) or '?'}.{name}"


def check_custom_loss(custom_loss: bool, family: TrainerFamily) -> None:
    if custom_loss and not family.accepts_per_example_loss:
        raise ValueError(
            f"per_example_loss is not supported by private {family.name} training: its unit's loss is not a function "
            "of (model, outputs, labels) but the family's own (DPO's pair loss, chosen by DPOConfig.loss_type), "
            "computed for each unit alone. Choose the loss in the trainer's config and drop per_example_loss."
        )


def check_trainer_kwargs(kwargs: dict[str, Any], family: TrainerFamily, dp_config: MethodConfig) -> None:
    """Trainer keywords that cannot be honoured under DP-SGD, then the family's own (with this DP method)."""
    for keyword in family.refused_keywords:
        if keyword.is_refused(kwargs.get(keyword.name), dp_config):
            raise ValueError(f"{keyword.name} is not supported with {type(dp_config).__name__}: {keyword.reason}")
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


# ---------------------------------------------------------------------- TrainingArguments
# report_to integrations that write only to this machine; every other one may send the logs elsewhere.
_LOCAL_LOGGERS = ("none", "tensorboard", "codecarbon")


def check_arguments(
    args: TrainingArguments,
    max_grad_norm: float,
    custom_loss: bool,
    trainer_class: type[Trainer],
    family: TrainerFamily,
    model: nn.Module,
) -> None:
    """The training settings (the trainer family's own first), then what a run may publish."""
    check_family_settings(args, family, model)
    check_training_args(args, max_grad_norm, custom_loss, trainer_class)
    check_release_settings(args)


def check_family_settings(args: TrainingArguments, family: TrainerFamily, model: nn.Module) -> None:
    """The settings of a trainer family (TRL's SFTConfig) that would change what is clipped, refused by name."""
    for setting in family.refused_settings:
        if setting.is_on(args, model):
            value = getattr(args, setting.name, None)
            raise ValueError(
                f"{setting.name}={value!r} is not supported by private {family.name} training: {setting.reason}"
            )


def check_training_args(
    args: TrainingArguments, max_grad_norm: float, custom_loss: bool, trainer_class: type[Trainer] = Trainer
) -> None:
    """Refuse what cannot be honoured; replace Trainer's gradient clipping by the per-example clip, saying so."""
    if args.fp16:
        raise ValueError("fp16 with a GradScaler rescales gradients before clipping; use bf16=True or fp32.")
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
            "machine. Use report_to='tensorboard' or 'none', or keep those runs private.",
            remote,
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
            "it to the DP config (e.g. DPConfig(max_grad_norm=%g)).",
            value,
            max_grad_norm,
            value,
            value,
        )
    else:
        logger.info("Trainer's clipping of the summed gradient is off; each example is clipped to C=%g.", max_grad_norm)
    args.max_grad_norm = 0.0


# ---------------------------------------------------------------------- model
_SUPPORTED_PARALLELISM = (
    "hf_private supports one process per device (DDP through `accelerate launch --multi_gpu --num_processes N`, "
    "or torchrun), each holding the whole model, and FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`, or "
    "TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2}))."
)


def check_model(model: nn.Module | None) -> nn.Module:
    """The model itself (not a wrapper), without layers that mix examples; returned once checked (whether each
    trainable parameter has a per-example gradient rule is the engine's check)."""
    if model is None:
        raise ValueError("PrivateTrainer needs a model; model_init (hyperparameter search) is not supported.")
    if isinstance(model, str):
        raise ValueError(
            f"Pass the model itself, not its name {model!r}: the model is checked (and the DP method may choose "
            "what trains) before the trainer is built. Load it first, e.g. "
            "AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)."
        )
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
    return model


def check_user_level_method(dp_config: MethodConfig) -> None:
    """At user level the guarantee is stated for a user: a method with no guarantee at any unit (DP-FP as published)
    is refused rather than given a user-level label. Every other method's releases sample the unit (users under ULS,
    through the trainer's sampler; capped examples under ELS, accounted with k), so they are covered."""
    if dp_config.privacy_unit != "user":
        return
    lacking = [stage.name for stage in dp_config.build_method().stages() if stage.no_guarantee]
    if lacking:
        raise ValueError(
            f"{type(dp_config).__name__} as configured has no formal guarantee (stages {lacking}), for a record or a "
            "user, so privacy_unit='user' would label a guarantee that does not exist. Use DPFPConfig(mode='sound') "
            "(its DP-SGD head is clipped per user) or another method."
        )


def check_user_level_arguments(args: TrainingArguments, dp_config: MethodConfig) -> None:
    """What user-level sampling cannot honour yet."""
    if dp_config.privacy_unit != "user":
        return
    if getattr(args, "train_sampling_strategy", "random") == "group_by_length":
        raise ValueError(
            "train_sampling_strategy='group_by_length' is not supported at privacy_unit='user': chunks "
            "hold whole users, not examples sorted by length. Use the default 'random'."
        )


# ---------------------------------------------------------------------- dataset and labels
def check_dataset(dataset: Any) -> int:
    """The size N of a map-style training set with at least one example."""
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


def check_labels(dataset: Any) -> LabelCounts:
    """Refuse NaN or ±inf float labels while refusing spends no privacy (the engine would give such an example a zero
    contribution: the record would silently never be learnt from); else what was counted. The message names columns
    and counts, never a row: it may end up in shared logs."""
    counts = count_labels(dataset)
    bad = {column: count for column, count in counts.non_finite.items() if count}
    if bad:
        found = ", ".join(f"{count} in column {column!r}" for column, count in bad.items())
        raise ValueError(
            f"train_dataset has non-finite float labels (NaN or inf): {found}. Such an example gets no gradient "
            "(a non-finite example contributes zero to every private step), so fix or remove these records "
            "before training."
        )
    return counts


# ---------------------------------------------------------------------- release settings
# Hub strategies that upload whole checkpoints (trainer_state.json, optimizer and RNG state).
_LOCAL_ONLY_STRATEGIES = (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)


def check_release_settings(args: TrainingArguments) -> None:
    """Refuse TrainingArguments that would publish un-noised functions of the private data."""
    if args.include_num_input_tokens_seen not in ("no", False):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: the token count of each Poisson "
            "batch is an un-noised function of the private data (who was sampled, how long their text is), logged "
            "and saved in trainer_state.json. Set include_num_input_tokens_seen='no'."
        )
    if args.push_to_hub and args.hub_strategy in _LOCAL_ONLY_STRATEGIES:
        raise ValueError(
            f"hub_strategy={HubStrategy(args.hub_strategy).value!r} uploads whole checkpoints: trainer_state.json "
            "(un-noised training losses, data-dependent counters) and the optimizer and RNG state. Use "
            "hub_strategy='every_save' or 'end', which push only the released artefacts (weights or adapter, configs, "
            f"tokenizer, {DP_CONFIG_NAME}, {LEDGER_NAME}, the card); checkpoints stay in output_dir for resuming."
        )


# ---------------------------------------------------------------------- parallelism and launch
def check_parallelism(trainer: Trainer) -> None:
    """One process per device, each holding the whole model: what Trainer's accelerator set up, read on the built
    Trainer."""
    if trainer.args.n_gpu > 1:
        raise ValueError(f"torch DataParallel (several GPUs in one process) is not supported: {_SUPPORTED_PARALLELISM}")
    if trainer.is_deepspeed_enabled:
        raise ValueError(
            "DeepSpeed ZeRO shards gradients before a flat per-example clip is possible: " + _SUPPORTED_PARALLELISM
        )
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # `accelerate launch --use_fsdp` on accelerators
    if trainer.is_fsdp_enabled and (plugin is None or plugin.fsdp_version != 2):
        raise ValueError("FSDP1 is not supported: " + _SUPPORTED_PARALLELISM)
    check_sharded_mesh(trainer.accelerator)
    if trainer.is_model_parallel or trainer.is_distributed_loading_by_transformers:  # Trainer's own reading
        raise ValueError(
            "Model or tensor parallelism (one model split over several devices) is not supported: "
            + _SUPPORTED_PARALLELISM
        )


# Where launchers put the number of processes: torchrun and accelerate's multi-GPU launcher, then MPI (the variables
# accelerate reads for a multi-CPU run).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# Set by every `accelerate launch` (simple, multi-GPU, ...) in the processes it starts.
_ACCELERATE_LAUNCH_VARIABLE = "ACCELERATE_MIXED_PRECISION"

_FIX = (
    "Start several processes with `accelerate launch --multi_gpu --num_processes N` (on CPU with use_cpu=True, "
    "`--use_cpu true` in the recipe, or ACCELERATE_USE_CPU=1): `--cpu` always starts a single process, and "
    "accelerate refuses it together with --multi_gpu."
)


def check_process_count(world_size: int) -> None:
    """Warn when this run has fewer processes than its launcher was asked for.

    `accelerate launch --cpu --num_processes 2` (and `--num_processes 2` without `--multi_gpu` on a machine without
    several GPUs) uses accelerate's simple launcher, which starts ONE process: the run trains, just not as the user
    asked, and nothing says so. The requested count is not passed on, but the launch leaves traces in the
    environment: launchers that start several processes give each its world size (WORLD_SIZE, or MPI's variables),
    and the simple launcher sets MASTER_ADDR only when asked for more than one process.
    """
    sizes = [int(value) for name in _WORLD_SIZE_VARIABLES if (value := os.environ.get(name, "").strip()).isdigit()]
    if sizes:
        if world_size >= sizes[0]:
            return
        asked = f"{sizes[0]} processes"
    elif world_size == 1 and _ACCELERATE_LAUNCH_VARIABLE in os.environ and os.environ.get("MASTER_ADDR"):
        asked = "more than one process (accelerate launch set MASTER_ADDR, which it does only for --num_processes > 1)"
    else:
        return
    logger.warning(
        "The launch asked for %s, but this run has %d: the logical batch (per_device_train_batch_size × "
        "gradient_accumulation_steps × processes) is smaller than planned. %s",
        asked,
        world_size,
        _FIX,
    )
