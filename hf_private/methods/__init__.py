"""One folder per DP method (config + behaviour), each registered under its canonical name on import."""

from __future__ import annotations

from .base import (
    DPMethod,
    MethodConfig,
    RecipeDefaults,
    method_class,
    register_dp_method,
    registered_methods,
)
from .bitfit import BitFitConfig
from .dpsgd import DPConfig
from .frost import FrostConfig
from .lora import DPLoRAConfig

__all__ = [
    "BitFitConfig", "DPConfig", "DPLoRAConfig", "FrostConfig",
    "DPMethod", "MethodConfig", "RecipeDefaults", "method_class",
    "register_dp_method", "registered_methods",
]
