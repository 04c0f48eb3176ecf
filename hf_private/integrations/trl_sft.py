"""TRL's `SFTTrainer` (trl ≥ 1.16), privatized: one unit is one training sequence (a text, a prompt with its
completion, or a conversation), and its loss is its own mean over its own trained tokens. With `padding_free=True`
the sequences of each chunk are packed into one row (`hf_private.packing`), each still clipped alone.

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

from .base import RefusedSetting, TrainerFamily
from .trl_shared import KERNEL_AND_BATCH_SETTINGS, PACKING_ISSUE, PEFT_CONFIG


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
            "packing packs the dataset before sampling ('bfd_split' and 'wrapped' also split a sequence over rows), "
            "so the Poisson sampler would draw packed rows of sequences fixed together, and a clipped row would not "
            f"be one privacy unit; {PACKING_ISSUE}. Set packing=False and padding_free=True (with max_length=None "
            "or truncated sequences): the same padding-free compute, each sequence clipped alone."),
        RefusedSetting(
            "loss_type", lambda args, model: getattr(args, "loss_type", "nll") != "nll",
            "only loss_type='nll' has a per-sequence loss here (each sequence's mean negative log-likelihood over "
            "its own trained tokens). Set loss_type='nll'."),
        *KERNEL_AND_BATCH_SETTINGS,
    )
    refused_keywords = (PEFT_CONFIG,)

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
