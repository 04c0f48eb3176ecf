"""One handler per layer type; adding a layer type is adding one file that registers itself."""

from . import conv, conv1d, embedding, layer_norm, linear, moe, rms_norm  # noqa: F401  (registration on import)
from . import learned_positions, relative_position_bias  # noqa: F401  (encoder-decoder position rules)
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
