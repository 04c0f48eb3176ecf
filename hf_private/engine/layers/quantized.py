"""Quantized base weights (bitsandbytes 4-bit and 8-bit) have no per-example gradient rule: refused when trainable.

A QLoRA base is frozen and only its LoRA adapters train (plain `nn.Linear` modules, the linear rule). A quantized
weight itself can only be left trainable in bitsandbytes' 8-bit layers kept with float weights
(`llm_int8_has_fp16_weight=True`): their forward quantizes on the fly in kernels that the generic rule cannot replay
per example, so it would fail deep inside bitsandbytes with no hint of what to change. The refusal says it instead.
bitsandbytes is recognised by the parameter's class, so it is never imported here.
"""

from __future__ import annotations

from torch import nn

from .base import LayerHandler, UnsupportedLayerError


def quantized_parameter_names(module: nn.Module, names: set[str]) -> tuple[str, ...]:
    """Which of the parameters `names` (of the module or, dotted, of a child it claims) are bitsandbytes-quantized
    (Params4bit, Int8Params)."""
    return tuple(
        sorted(n for n in names if type(module.get_parameter(n)).__module__.partition(".")[0] == "bitsandbytes")
    )


class QuantizedWeightRefusal(LayerHandler):
    """The rule of a module with a trainable quantized weight: none, said when the engine is built."""

    rule = "refused (trainable quantized weight)"

    def __init__(self, params: tuple[str, ...]) -> None:
        self.params = params

    def check(self, module: nn.Module, trainable: set[str]) -> None:
        raise UnsupportedLayerError(
            f"its quantized (bitsandbytes) parameter(s) {list(self.params)} are trainable: per-example gradients of "
            "a quantized weight are not supported. Freeze the quantized base (peft's prepare_model_for_kbit_training "
            "does) and train LoRA adapters on it (QLoRA; see docs/guides/quantized-bases.md)."
        )
