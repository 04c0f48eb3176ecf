"""`BitFitConfig`: DP-BiTFiT (Bu et al., ICML 2024) — DP-SGD on bias terms, optionally after X epochs of DP full
fine-tuning ("X+BiTFiT"), all in one privacy ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from ..dpsgd import DPConfig
from .model import select_bitfit_parameters


@dataclass
class BitFitConfig(DPConfig):
    method: ClassVar[str] = "dp-bitfit"

    train_head: bool = field(
        default=True,
        metadata={
            "help": "Also train the task head (inside the same clip and noise). The paper leaves a new head at its "
            "random initialisation, which gives chance-level accuracy on new heads; False reproduces the paper."
        },
    )
    train_norm_weights: bool = field(
        default=False, metadata={"help": "Also train LayerNorm/RMSNorm gains (cheap: B×d per layer)."}
    )
    full_finetune_epochs: float = field(
        default=0.0,
        metadata={
            "help": "X of 'X+BiTFiT': DP full fine-tuning for the first X epochs, then DP-BiTFiT. X must be fixed "
            "in advance: choosing it on private validation data is hyperparameter tuning."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.full_finetune_epochs < 0:
            raise ValueError(f"full_finetune_epochs must be >= 0, got {self.full_finetune_epochs}.")

    def prepare_model(self, model: nn.Module) -> None:
        if self.full_finetune_epochs > 0:
            model.requires_grad_(True)  # phase 1 is DP full fine-tuning
        else:
            self.select_phase_two(model)

    def select_phase_two(self, model: nn.Module) -> None:
        select_bitfit_parameters(model, train_head=self.train_head, train_norm_weights=self.train_norm_weights)

    def phases(self) -> list[tuple[str, float]]:
        if self.full_finetune_epochs > 0:
            return [("dp-sgd-full", self.full_finetune_epochs), ("dp-bitfit", float("inf"))]
        return [("dp-bitfit", float("inf"))]

    def citations(self) -> tuple[str, ...]:
        return (*super().citations(),
                "Bu, Wang, Zha, Karypis, *Differentially Private Bias-Term Fine-tuning of Foundation Models*, "
                "ICML 2024.")
