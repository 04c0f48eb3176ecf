"""hf_private: differentially private fine-tuning of Hugging Face models, with an honest guarantee."""

from .engine import UnsupportedLayerError
from .methods import BitFitConfig, DPConfig
from .privacy import BudgetError
from .trainer import PrivateTrainer

__all__ = ["BitFitConfig", "BudgetError", "DPConfig", "PrivateTrainer", "UnsupportedLayerError"]
__version__ = "0.1.0"
