"""TRL's `SFTTrainer` (trl ≥ 1.16), privatized: one unit is one training sequence (a text, a prompt with its
completion, or a conversation), and its loss is its own mean over its own trained tokens. With `padding_free=True`
the sequences of each chunk are packed into one row (`hf_private.data.packing`), each still clipped alone; with
`packing=True` (BFD) TRL's packed rows are split back into their sequences first, so that sequences are sampled.

TRL prepares the data as usual (chat template, `completion_only_loss`, `assistant_only_loss`, `max_length`,
`formatting_func`, ...) and folds every mask into the labels (-100 on untrained tokens), so the per-unit loss is
the causal-LM per-example loss (`hf_private.integrations.losses.default_per_example_loss`): Σ_t ℓ_t / (trained tokens
of this
sequence). TRL's own training loss divides the batch's token losses by the trained tokens of the whole batch
(`num_items_in_batch`): under DP that couples examples (each example's gradient would depend on the lengths of its
batch-mates), so it is never used in training; `SFTTrainer.compute_loss` serves evaluation only.

SFT's own training metrics (entropy, mean_token_accuracy, num_tokens) are computed by `SFTTrainer.compute_loss` on
the private batch without noise: the private training path never calls it, so `SFTTrainer.log` finds no training
metrics to add. Evaluation metrics are computed as TRL computes them.

Nothing here imports trl: this module is loaded only for a class that comes from trl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

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
            "packing_strategy",
            lambda args, model: (
                bool(getattr(args, "packing", False)) and getattr(args, "packing_strategy", "bfd") != "bfd"
            ),
            "'bfd_split' and 'wrapped' split a sequence over packed rows, so no row holds whole privacy units and a "
            f"sequence's parts would be clipped apart; {PACKING_ISSUE}. Use packing_strategy='bfd' (each sequence "
            "truncated to max_length, whole) or padding_free=True.",
        ),
        RefusedSetting(
            "loss_type",
            lambda args, model: getattr(args, "loss_type", "nll") != "nll",
            "only loss_type='nll' has a per-sequence loss here (each sequence's mean negative log-likelihood over "
            "its own trained tokens). Set loss_type='nll'.",
        ),
        *KERNEL_AND_BATCH_SETTINGS,
    )
    refused_keywords = (PEFT_CONFIG,)

    def check_columns(self, train_dataset: Any, args: Any, trainer_kwargs: Mapping[str, Any]) -> None:
        """The columns SFTTrainer prepares from (trl 1.16's `_prepare_dataset`): tokenized `input_ids`; else, unless
        a `formatting_func` makes the text, `prompt` with `completion`, `messages` (or `conversations`), or the text
        column (`dataset_text_field`). TRL would fail on a missing one with a bare KeyError."""
        columns = getattr(train_dataset, "column_names", None)
        dataset_kwargs = getattr(args, "dataset_kwargs", None) or {}
        if (
            columns is None
            or "input_ids" in columns
            or trainer_kwargs.get("formatting_func") is not None
            or dataset_kwargs.get("skip_prepare_dataset", False)
        ):
            return
        text_field = getattr(args, "dataset_text_field", "text")
        if "prompt" in columns:
            if "completion" not in columns:
                raise ValueError(
                    f"train_dataset has columns {columns}: SFTTrainer reads a 'prompt' column as a prompt-completion "
                    "dataset, and the 'completion' column is missing. Add it (the text trained on after each "
                    "prompt), or rename 'prompt' to 'text' to train on it as plain text."
                )
            return
        if {"messages", "conversations"} & set(columns) or text_field in columns:
            return
        raise ValueError(
            f"train_dataset has columns {columns}, none of which SFTTrainer prepares from: a text column "
            f"{text_field!r} (SFTConfig.dataset_text_field), 'messages' (conversations), 'prompt' with 'completion', "
            f"or tokenized 'input_ids'. Rename your text column (train_dataset.rename_column(name, {text_field!r})), "
            "set SFTConfig(dataset_text_field=name), or pass formatting_func=... to build each example's text."
        )

    def training_set(self, dataset: Any, args: Any) -> Any:
        """With packing=True (BFD) TRL packs the dataset into rows of whole sequences before training; sampled as
        they are, a row of sequences fixed together would be the unit. The rows are split back into their sequences
        (as BFD truncated them), which the sampler then draws one by one; the padding-free collator packs each
        sampled chunk into one row, and the engine clips every sequence alone."""
        if not getattr(args, "packing", False) or dataset is None or "seq_lengths" not in dataset.column_names:
            return dataset
        return unpack_rows(dataset)

    def unmarked_units(self, args: Any) -> str | None:
        """Evaluation sets are packed with `eval_packing` (else `packing`) and the same `packing_strategy`, which
        only `packing=True` restricts to 'bfd': 'bfd_split' and 'wrapped' cut sequences across rows."""
        packing = args.packing if getattr(args, "eval_packing", None) is None else args.eval_packing
        strategy = getattr(args, "packing_strategy", "bfd")
        if not packing or strategy == "bfd":
            return None
        return (
            f"SFTTrainer packs evaluation sets with packing_strategy={strategy!r}, which cuts sequences across "
            "rows, so a row's pieces cannot be matched to whole training sequences (use "
            "packing_strategy='bfd' or eval_packing=False)"
        )

    def unit(self, train_dataset: Any) -> str:
        """ "conversation" (messages, or a conversational prompt and completion), "prompt-completion pair", or
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


def unpack_rows(dataset: Any) -> Any:
    """Every packed row's token columns cut at its `seq_lengths`: one row per sequence, `seq_lengths` dropped."""
    columns = [name for name in dataset.column_names if name != "seq_lengths"]

    def split(rows: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in columns}
        for i, lengths in enumerate(rows["seq_lengths"]):
            offsets = np.cumsum([0, *lengths])
            for name in columns:
                out[name].extend(rows[name][i][a:b] for a, b in zip(offsets[:-1], offsets[1:]))
        return out

    return dataset.map(split, batched=True, remove_columns=dataset.column_names, desc="Unpacking sequences")


FAMILY = SFTFamily()
