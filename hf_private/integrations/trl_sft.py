"""TRL's `SFTTrainer` (trl ≥ 1.16), privatized: one unit is one training sequence (a text, a prompt with its
completion, or a conversation), and its loss is its own mean over its own trained tokens.

TRL prepares the data as usual (chat template, `completion_only_loss`, `assistant_only_loss`, `max_length`,
`formatting_func`, ...) and folds every mask into the labels (-100 on untrained tokens), so the per-unit loss is
the causal-LM per-example loss (`hf_private.losses.default_per_example_loss`): Σ_t ℓ_t / (trained tokens of this
sequence). TRL's own training loss divides the batch's token losses by the trained tokens of the whole batch
(`num_items_in_batch`): under DP that couples examples (each example's gradient would depend on the lengths of its
batch-mates), so it is never used in training; `SFTTrainer.compute_loss` serves evaluation only.

SFT's own training metrics (entropy, mean_token_accuracy, num_tokens) are computed by `SFTTrainer.compute_loss` on
the private batch without noise: the private training path never calls it, so `SFTTrainer.log` finds no training
metrics to add. Evaluation metrics are computed as TRL computes them.

Nothing here imports trl: this module is loaded only for a class that comes from trl.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..methods import DPMethod, method_class
from .base import RefusedKeyword, RefusedSetting, TrainerFamily

PACKING_ISSUE = "exact per-document clipping of packed rows is not implemented yet (the packing issue lifts this)"


def _moe_aux_loss(args: Any, model: nn.Module) -> bool:
    """Whether SFTTrainer would add a Mixture-of-Experts load-balancing loss (its own rule, read before it runs)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(text_config, "router_aux_loss_coef", 0.0)
    return hasattr(text_config, "output_router_logits") and coef != 0.0


def _changes_what_trains(value: Any, dp_config: Any) -> bool:
    """A PEFT config lets TRL choose what trains; a DP method that wraps the model or chooses its trainable set
    itself (DP-LoRA, BiTFiT, FROST, sparse low-rank, DP-FP) would fight it."""
    if value is None:
        return False
    method = method_class(dp_config.method)
    return method.wrap_model is not DPMethod.wrap_model or method.prepare_model is not DPMethod.prepare_model


class SFTFamily(TrainerFamily):
    name = "trl.SFTTrainer"
    own_classes = ("trl.trainer.sft_trainer.SFTTrainer", "trl.trainer.base_trainer._BaseTrainer")
    compatible_overrides = {
        "training_step": "SFTTrainer.training_step only wraps Trainer.training_step in its activation-offloading "
                         "context, a no-op here (activation_offloading is refused)",
        "compute_loss": "the private training loss is each sequence's own mean over its trained tokens "
                        "(hf_private.integrations.trl_sft); SFTTrainer.compute_loss serves evaluation only",
        "log": "it adds SFT metrics computed by SFTTrainer.compute_loss, which training never calls",
        "_save_checkpoint": "it writes the model card (hf_private's) before Trainer's checkpoint",
        "prediction_step": "evaluation only",
        "evaluate": "evaluation only (it prepares a dataset passed to evaluate as training data is prepared)",
    }
    refused_settings = (
        RefusedSetting(
            "packing", lambda args, model: bool(getattr(args, "packing", False)),
            f"packing puts several sequences in one row (and 'bfd_split' or 'wrapped' splits a sequence over rows), "
            f"so a clipped row is not one privacy unit: {PACKING_ISSUE}. Set packing=False."),
        RefusedSetting(
            "padding_free", lambda args, model: bool(getattr(args, "padding_free", False)),
            "padding_free flattens the whole batch into one row, so per-example clipping would clip the batch. "
            "Set padding_free=False (each sequence is padded to a row of its own)."),
        RefusedSetting(
            "use_liger_kernel", lambda args, model: bool(getattr(args, "use_liger_kernel", False)),
            "Liger kernels replace the model's layers and loss with fused kernels that have no per-example gradient "
            "rule here, so nothing could be clipped per example. Set use_liger_kernel=False."),
        RefusedSetting(
            "loss_type", lambda args, model: getattr(args, "loss_type", "nll") != "nll",
            "only loss_type='nll' has a per-sequence loss here (each sequence's mean negative log-likelihood over "
            "its own trained tokens). Set loss_type='nll'."),
        RefusedSetting(
            "activation_offloading", lambda args, model: bool(getattr(args, "activation_offloading", False)),
            "offloading repacks the tensors saved for backward, including those the per-example gradient hooks "
            "read, which has not been verified to keep each example's gradient exact. Set "
            "activation_offloading=False."),
        RefusedSetting(
            "router_aux_loss_coef", _moe_aux_loss,
            "the Mixture-of-Experts load-balancing loss is computed over the router statistics of the whole batch, "
            "which couples examples, and it is not part of the per-sequence loss. Set router_aux_loss_coef=0.0."),
    )
    refused_keywords = (
        RefusedKeyword(
            "peft_config", _changes_what_trains,
            "peft_config lets TRL choose what trains (a PEFT adapter), but this DP method wraps the model or chooses "
            "its trainable tensors itself. Use DPConfig with peft_config (DP-SGD on the adapter), or this method "
            "without peft_config."),
    )

    def unit(self, train_dataset: Any) -> str:
        """"conversation" (messages, or a conversational prompt and completion), "prompt-completion pair", or
        "sequence" (a text, or a tokenized sequence)."""
        try:
            first = train_dataset[0]
        except (TypeError, IndexError, KeyError):
            return "sequence"
        if not isinstance(first, dict):
            return "sequence"
        if "messages" in first or "conversations" in first or isinstance(first.get("prompt"), list):
            return "conversation"
        if "prompt" in first and "completion" in first:
            return "prompt-completion pair"
        return "sequence"


FAMILY = SFTFamily()
