"""One example, its own rows: what a collated chunk must look like to the engine.

The engine clips per *example*, and checks every term against the number of examples in the chunk. That
number must come from the sampler (how many features were collated), never from a tensor shape: a packing
collator (`DataCollatorWithFlattening`) makes one row of a whole chunk, and clipping that row bounds the chunk,
not an example. The only layout with several rows per example that the engine groups exactly is a
multiple-choice head's (one row per choice, consecutive).

Left padding is the other structural way a chunk couples its examples: without `position_ids`, positions count
from the start of the row, so a left-padded example's positions depend on the longest example of its chunk
(absolute position embeddings make its gradient depend on its chunk-mates). Every chunk is checked for it here;
what structure cannot show (wrong `position_ids`, a layer that mixes examples) the independence probe tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..models.peft import unwrap_peft

#: tensors that always carry one entry per example (others may also broadcast one entry to all)
PER_EXAMPLE_KEYS = ("labels", "input_ids", "inputs_embeds")
#: keys only packing collators produce (sequence boundaries inside a shared row)
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_USE_PADDING = (
    "Per-example clipping would clip shared rows, not examples, and the privacy guarantee would not hold. Pad every "
    "example to a row of its own (DataCollatorWithPadding, DataCollatorForLanguageModeling, "
    "DataCollatorForSeq2Seq), or pack a causal LM's examples into one row with position_ids restarting at each "
    "(DataCollatorWithFlattening, TRL's padding_free=True), which hf_private clips per example."
)


def check_one_row_per_example(batch: Mapping[str, Any], num_examples: int) -> None:
    """Raise if the collated `batch` of `num_examples` features does not keep each example in rows of its own."""
    packing = sorted(set(batch) & set(PACKING_KEYS))
    if packing:
        raise ValueError(
            f"The collated batch has {packing}, which only packing collators produce: examples were "
            f"packed into shared rows. {_USE_PADDING}"
        )
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        allowed = (num_examples,) if key in PER_EXAMPLE_KEYS else (num_examples, 1)
        if value.shape[0] not in allowed:
            raise ValueError(
                f"The collated batch's {key!r} has shape {tuple(value.shape)} for {num_examples} examples (expected "
                f"a leading dimension of {' or '.join(map(str, sorted(set(allowed))))}): examples were packed into "
                f"shared rows. {_USE_PADDING}"
            )
    if _positions_restart(batch.get("position_ids"), batch.get("attention_mask")):
        raise ValueError(
            f"'position_ids' restart inside a row: several examples were packed into one row. {_USE_PADDING}"
        )
    if "position_ids" not in batch and _left_padded(batch.get("attention_mask")):
        raise ValueError(
            "The collated batch is left-padded (an attention_mask row has a 0 before a 1) and carries no "
            "'position_ids': each example's positions then count from the start of the row, so they depend on the "
            "longest example of its chunk, and with absolute position embeddings (BERT, GPT-2, ...) so does its "
            "gradient; clipping would not bound one example's influence. Pad on the right "
            "(tokenizer.padding_side = 'right'), or add position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) "
            "in the collator (and, for a causal LM, set the label of each example's first token to -100)."
        )


def _positions_restart(position_ids: Any, attention_mask: Any) -> bool:
    """Whether positions decrease between two attended tokens of a row (padding may carry any position)."""
    if not torch.is_tensor(position_ids) or position_ids.dim() < 2 or position_ids.shape[-1] < 2:
        return False
    decreasing = position_ids.diff(dim=-1) < 0
    if torch.is_tensor(attention_mask) and attention_mask.shape == position_ids.shape:
        attended = attention_mask != 0
        decreasing &= attended[..., 1:] & attended[..., :-1]
    return bool(decreasing.any())


def _left_padded(attention_mask: Any) -> bool:
    """Whether a row of a [B, T] (multiple choice: [B, C, T]) 0/1 padding mask has a 0 before a 1."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() not in (2, 3) or attention_mask.shape[-1] < 2:
        return False
    attended = attention_mask != 0
    # a 1 that follows some 0 of its row: the running count of zeros is positive where a token is attended
    zeros_before = (~attended).cumsum(-1)
    return bool((attended & (zeros_before > 0)).any())


def rows_per_example(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """Rows the model makes of each example: a `*ForMultipleChoice` head flattens [B, C, T] into B·C rows."""
    if not type(unwrap_peft(model)).__name__.endswith("ForMultipleChoice"):
        return 1
    for key, dims in (("input_ids", 3), ("inputs_embeds", 4)):
        value = inputs.get(key)
        if torch.is_tensor(value):
            if value.dim() != dims:
                raise ValueError(
                    f"A multiple-choice model needs {key} of {dims} dimensions ([batch, choices, ...]), "
                    f"got shape {tuple(value.shape)}; use DataCollatorForMultipleChoice."
                )
            return value.shape[1]
    raise ValueError(f"A multiple-choice batch needs input_ids or inputs_embeds; got keys {sorted(inputs)}.")
