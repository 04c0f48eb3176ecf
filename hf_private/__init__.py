"""hf_private: differentially private fine-tuning of Hugging Face models, with an honest guarantee."""

from .adapters import load_private_adapter
from .engine import UnsupportedLayerError
from .methods import (
    BitFitConfig,
    DPConfig,
    DPFPConfig,
    DPLoRAConfig,
    FrostConfig,
    SparseLowRankConfig,
    registered_methods,
)
from .privacy import BudgetError
from .trainer import PrivateTrainer

__all__ = [
    "BitFitConfig", "BudgetError", "DPConfig", "DPFPConfig", "DPLoRAConfig", "FrostConfig", "PrivateTrainer",
    "SparseLowRankConfig", "UnsupportedLayerError", "load_private_adapter", "registered_methods",
]
__version__ = "0.1.0"
