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
from .dpfp import DPFPConfig
from .dpsgd import DPConfig
from .frost import FrostConfig
from .lora import DPLoRAConfig
from .sparse_lowrank import SparseLowRankConfig

__all__ = [
    "BitFitConfig", "DPConfig", "DPFPConfig", "DPLoRAConfig", "DPMethod", "FrostConfig", "MethodConfig",
    "RecipeDefaults", "SparseLowRankConfig", "method_class", "register_dp_method", "registered_methods",
]
