"""DP-SGD's behaviour: the base method's defaults (train what is trainable, one stage), plus its recipe row."""

from __future__ import annotations

from ..base import DPMethod, RecipeDefaults, register_dp_method
from .config import DPConfig

# DP-BiTFiT Table 9 (methods_spec §3.5): RoBERTa, DP-Adam, Abadi clipping R = 0.1, max length 256, Li et al.'s
# setup; the same table gives the DP full fine-tuning learning rate. (batch, epochs) per task:
TABLE9_SCHEDULE = {"sst2": (1000, 3), "qnli": (2000, 6), "qqp": (6000, 18), "mnli": (6000, 18)}
TABLE9 = "DP-BiTFiT Table 9 (methods_spec §3.5)"


def table9_defaults(task: str, learning_rate: float, what: str) -> RecipeDefaults:
    batch, epochs = TABLE9_SCHEDULE.get(task, TABLE9_SCHEDULE["sst2"])
    return RecipeDefaults(batch, epochs, learning_rate, 0.1, 256, f"{TABLE9}, {what}",
                          from_paper=task in TABLE9_SCHEDULE)


@register_dp_method(DPConfig)
class DPSGDMethod(DPMethod):
    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return table9_defaults(task, 5e-4, "DP full fine-tuning")
