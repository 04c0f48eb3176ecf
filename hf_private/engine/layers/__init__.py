"""One handler per layer type; adding a layer type is adding one file that registers itself."""

from . import (  # noqa: F401  (registration on import)
    conv,
    conv1d,
    embedding,
    layer_norm,
    learned_positions,
    linear,
    moe,
    moe_lora,
    relative_position_bias,
    rms_norm,
)
from .base import LayerHandler, UnsupportedLayerError
from .registry import handler_for, register_layer, supported_layer_names
from .rules import rule_for

__all__ = [
    "LayerHandler",
    "UnsupportedLayerError",
    "handler_for",
    "register_layer",
    "rule_for",
    "supported_layer_names",
]
