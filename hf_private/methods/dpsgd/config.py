"""`DPConfig`: plain DP-SGD on whatever the model has trainable (full fine-tuning, or a PEFT model you built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import CONFIG_NAME, MethodConfig
from ..shared import DP_SGD

__all__ = ["CONFIG_NAME", "DPConfig"]


@dataclass
class DPConfig(MethodConfig):
    """Differentially private SGD with Poisson sampling, one flat per-example clip and Gaussian noise.

    Methods that are DP-SGD on a chosen set of tensors (DP-LoRA, DP-BiTFiT) subclass this config.
    """

    method: ClassVar[str] = DP_SGD
