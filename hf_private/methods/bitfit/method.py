"""DP-BiTFiT's behaviour: biases (and the head) train; with X+BiTFiT, a first stage of DP full fine-tuning."""

from __future__ import annotations

from torch import nn

from ...privacy.plan import Stage
from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..shared import DP_SGD, table9_defaults
from .config import BitFitConfig
from .model import select_bitfit_parameters


@register_dp_method(BitFitConfig)
class BitFitMethod(DPMethod):
    config: BitFitConfig

    def prepare_model(self, model: nn.Module) -> None:
        if self.config.full_finetune_epochs > 0:
            model.requires_grad_(True)  # stage 1 is DP full fine-tuning
        else:
            self.start_stage(1, model)

    def start_stage(self, index: int, model: nn.Module) -> None:
        select_bitfit_parameters(
            model, train_head=self.config.train_head, train_norm_weights=self.config.train_norm_weights
        )

    def stages(self) -> list[Stage]:
        bitfit = Stage(self.name, sensitivity="flat L2 clip C over biases (and the head)")
        if self.config.full_finetune_epochs > 0:  # X+BiTFiT: same σ and q, one ledger
            return [
                Stage(
                    DP_SGD, epochs=self.config.full_finetune_epochs, sensitivity="flat L2 clip C over every parameter"
                ),
                bitfit,
            ]
        return [bitfit]

    def citations(self) -> tuple[str, ...]:
        return (
            *super().citations(),
            "Bu, Wang, Zha, Karypis, *Differentially Private Bias-Term Fine-tuning of Foundation Models*, ICML 2024.",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return table9_defaults(task, 5e-3, "DP-BiTFiT")
