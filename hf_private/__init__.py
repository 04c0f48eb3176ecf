"""hf_private: differentially private fine-tuning of Hugging Face models, with an honest guarantee."""

from .clip_norm import median_gradient_norm, public_calibration_texts
from .data.packing import PackedClassificationCollator
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
from .models.head_choice import sentence_classifier
from .models.heads import MeanPooledBertForSequenceClassification, MeanPooledRobertaForSequenceClassification
from .privacy import BudgetError
from .release.adapters import load_private_adapter
from .trainer import PrivateTrainer, privatize
from .version import __version__ as __version__  # re-exported: hf_private.__version__

__all__ = [
    "BitFitConfig",
    "BudgetError",
    "DPConfig",
    "DPFPConfig",
    "DPLoRAConfig",
    "FrostConfig",
    "MeanPooledBertForSequenceClassification",
    "MeanPooledRobertaForSequenceClassification",
    "PackedClassificationCollator",
    "PrivateTrainer",
    "SparseLowRankConfig",
    "UnsupportedLayerError",
    "load_private_adapter",
    "median_gradient_norm",
    "privatize",
    "public_calibration_texts",
    "registered_methods",
    "sentence_classifier",
]
