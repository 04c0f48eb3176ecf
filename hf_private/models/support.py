"""Model-family facts the launch checks and the per-example losses read.

Whether a model trains privately is decided layer by layer, not by family: every trainable parameter needs an exact
per-example gradient rule (`engine/layers/`), and the engine refuses, naming the module, what has none. Encoder-decoder
models (T5, BART) are no exception: their privacy unit is one (source, target) pair, one row of each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .peft import unwrap_peft


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only language model head (Llama-style `*ForCausalLM`, GPT-2's `*LMHeadModel`), PEFT-wrapped or not."""
    name = type(unwrap_peft(model)).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def is_seq2seq_lm(model: nn.Module) -> bool:
    """An encoder-decoder language model whose decoder reads its labels shifted right (T5ForConditionalGeneration,
    BartForConditionalGeneration), PEFT-wrapped or not: one privacy unit is a (source, target) pair, the source in
    `input_ids`, the target in `labels`. An encoder-decoder config alone does not make one (UMT5's token classifier
    keeps `is_encoder_decoder=True` with no decoder)."""
    base = unwrap_peft(model)
    encoder_decoder = getattr(getattr(base, "config", None), "is_encoder_decoder", False) is True
    return encoder_decoder and callable(getattr(base, "prepare_decoder_input_ids_from_labels", None))


def with_decoder_inputs(model: nn.Module, inputs: dict, labels: torch.Tensor) -> dict:
    """An encoder-decoder LM's inputs with its decoder inputs made from the labels, when the batch has none.

    Handed `labels`, such a model shifts them right into `decoder_input_ids` itself (T5's `_shift_right`, BART's
    `shift_tokens_right`: -100 replaced by the pad id) and computes a batch-mean loss, which would couple the examples.
    The per-example loss keeps the labels from it, so the shift is done here with the model's own
    `prepare_decoder_input_ids_from_labels`: each pair's decoder reads only its own target.
    """
    if not is_seq2seq_lm(model) or "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    base: Any = unwrap_peft(model)
    return {**inputs, "decoder_input_ids": base.prepare_decoder_input_ids_from_labels(labels=labels)}
