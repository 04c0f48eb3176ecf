"""Which rule computes a module's per-example gradients: a dedicated one by exact type, one matched by probing the
module's forward, or the generic per-module VJP."""

from __future__ import annotations

from torch import nn

from .base import LayerHandler
from .matched import matched_handler
from .module_vjp import ModuleVJPHandler
from .quantized import QuantizedWeightRefusal, quantized_parameter_names
from .registry import handler_for


def rule_for(module: nn.Module, trainable: set[str]) -> LayerHandler:
    """The rule for a module whose parameters `trainable` train: its dedicated rule when that covers them all, else a
    fast rule its forward was shown to match, else the generic rule for the whole module; none for a trainable
    quantized weight (refused by its `check`)."""
    quantized = quantized_parameter_names(module, trainable)
    if quantized:
        return QuantizedWeightRefusal(quantized)
    handler = handler_for(module)
    if handler is not None and trainable <= set(handler.params):
        return handler
    return matched_handler(module, trainable) or ModuleVJPHandler(tuple(sorted(trainable)))
