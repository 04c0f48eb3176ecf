"""Which model families private training refuses as a whole: the facts `preflight.check_supported_model` reads.

Layer-level support (which trainable parameters have an exact per-example gradient) is the engine's business
(`engine/layers/`); encoder-decoder models are refused whole, whatever parameters are frozen, because their
per-example clipping has never been verified (the refusal and its message are in `preflight`).
"""

from __future__ import annotations

from torch import nn

from .peft import unwrap_peft


class UnsupportedModelError(ValueError):
    """The model family is not supported by private training."""


def encoder_decoder_submodule(model: nn.Module) -> str | None:
    """The name of the first submodule ("" for the model itself) whose `config.is_encoder_decoder` is True, else None.

    Every submodule's `config` is read, so a PEFT-wrapped or user-wrapped encoder-decoder model is found too;
    encoder-only heads of such a family (T5EncoderModel, T5ForTokenClassification) set it False.
    """
    for name, module in model.named_modules():
        if getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True:
            return name
    return None


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only language model head (Llama-style `*ForCausalLM`, GPT-2's `*LMHeadModel`), PEFT-wrapped or not."""
    name = type(unwrap_peft(model)).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
