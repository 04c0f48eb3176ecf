"""Per-example gradient engine (hooks on the model's own modules, one backward pass, a pluggable reducer)."""

from .core import ChunkTransform, ChunkUnits, PerExampleGradientEngine, trainable_parameters
from .layers import UnsupportedLayerError, register_layer, supported_layer_names
from .reducers import ChunkTerms, FlatL2ClipReducer, Reducer

__all__ = [
    "ChunkTerms",
    "ChunkTransform",
    "ChunkUnits",
    "FlatL2ClipReducer",
    "PerExampleGradientEngine",
    "Reducer",
    "UnsupportedLayerError",
    "register_layer",
    "supported_layer_names",
    "trainable_parameters",
]
