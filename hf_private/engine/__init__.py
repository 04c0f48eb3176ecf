"""Per-example gradient engine (hooks on the model's own modules, one backward pass)."""

from .core import PerExampleGradientEngine, trainable_parameters
from .layers import UnsupportedLayerError, register_layer, supported_layer_names

__all__ = ["PerExampleGradientEngine", "UnsupportedLayerError", "register_layer", "supported_layer_names",
           "trainable_parameters"]
