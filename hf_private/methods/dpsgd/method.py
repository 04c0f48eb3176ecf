"""DP-SGD's behaviour: the base method's defaults (train what is trainable, one stage), plus its recipe row."""

from __future__ import annotations

from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..shared import table9_defaults
from .config import DPConfig


@register_dp_method(DPConfig)
class DPSGDMethod(DPMethod):
    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return table9_defaults(task, 5e-4, "DP full fine-tuning")
