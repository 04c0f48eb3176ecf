"""`DPConfig`: plain DP-SGD on whatever the model has trainable (full fine-tuning, or a PEFT model you built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import MethodConfig
from ..shared import DP_SGD


@dataclass
class DPConfig(MethodConfig):
    """Differentially private SGD with Poisson sampling, one flat per-example clip and Gaussian noise.

    Every other method's config derives from `MethodConfig`, as this one does, not from it: `DPConfig.from_pretrained`
    reads DP-SGD files only, `MethodConfig.from_pretrained` any registered method's.
    """

    method: ClassVar[str] = DP_SGD
