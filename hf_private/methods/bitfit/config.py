"""`BitFitConfig`: DP-BiTFiT (Bu et al., ICML 2024) — DP-SGD on bias terms, optionally after X epochs of DP full
fine-tuning ("X+BiTFiT"), all in one privacy ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..base import MethodConfig


@dataclass
class BitFitConfig(MethodConfig):
    """DP-BiTFiT: DP-SGD on the bias terms (and by default the new task head), optionally after X epochs of DP full
    fine-tuning, in one ledger."""

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
