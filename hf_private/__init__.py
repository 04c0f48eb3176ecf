"""hf_private: differentially private fine-tuning of Hugging Face models, with an honest guarantee."""

from .adapters import load_private_adapter
from .engine import UnsupportedLayerError
from .methods import BitFitConfig, DPConfig
from .privacy import BudgetError
from .trainer import PrivateTrainer

__all__ = ["BitFitConfig", "BudgetError", "DPConfig", "PrivateTrainer", "UnsupportedLayerError", "load_private_adapter"]
__version__ = "0.1.0"
