"""`privatize(TrainerClass)`: any `transformers.Trainer` subclass, made differentially private; `PrivateTrainer` is
`Trainer` made so. The private class is the user's class with `PrivateTrainingMixin` placed first in its MRO."""

from __future__ import annotations

from transformers import Trainer

from .mixin import PrivateTrainingMixin


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
        _PRIVATE_CLASSES[trainer_class] = type(
            name,
            (PrivateTrainingMixin, trainer_class),
            {
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"`{trainer_class.__name__}` plus `dp_config` (see `hf_private.privatize`).",
            },
        )
    return _PRIVATE_CLASSES[trainer_class]
