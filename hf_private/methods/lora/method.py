"""DP-LoRA: wrap the model with PEFT LoRA (unless it already is a PeftModel), then plain DP-SGD on what trains."""

from __future__ import annotations

from torch import nn

from ...logs import get_logger
from ...models.peft import is_peft_model
from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..shared import apply_lora
from .config import DPLoRAConfig

logger = get_logger(__name__)

# Seed 003 §4.8: the LoRA + DP-SGD baseline (after Yu et al. 2022), SST-2 and QNLI: B 2000, 20 epochs, lr 1e-3,
# C = 10; plain LoRA did best at rank 16. The max length is not stated; 256 as in Table 9.
_SEED003_TASKS = ("sst2", "qnli")
_SEED003 = "seed 003 §4.8 LoRA+DP-SGD baseline (methods_spec §4.8)"


@register_dp_method(DPLoRAConfig)
class DPLoRAMethod(DPMethod):
    config: DPLoRAConfig

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if is_peft_model(model):
            logger.info("The model is already a PeftModel: training its adapters as they are (lora_* fields unused).")
            return model
        return apply_lora(model, self.config.lora_r, self.config.lora_alpha, self.config.lora_target_modules)

    def citations(self) -> tuple[str, ...]:
        return (
            *super().citations(),
            "Hu et al., *LoRA: Low-Rank Adaptation of Large Language Models*, ICLR 2022.",
            "Yu et al., *Differentially Private Fine-tuning of Language Models*, ICLR 2022.",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return RecipeDefaults(
            2000,
            20,
            1e-3,
            10.0,
            256,
            _SEED003,
            from_paper=task in _SEED003_TASKS,
            method_fields={"lora_r": 16, "lora_alpha": 16},
        )
