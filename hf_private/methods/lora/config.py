"""`DPLoRAConfig`: DP-SGD on PEFT LoRA factors (and the new task head) of a frozen pre-trained model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..base import MethodConfig


@dataclass
class DPLoRAConfig(MethodConfig):
    """DP-LoRA: wraps a plain model with PEFT LoRA (a PeftModel is trained as it is), then DP-SGD on the factors and
    the new task head."""

    method: ClassVar[str] = "dp-lora"

    lora_r: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha (the update is scaled by alpha / r)."})
    lora_target_modules: str | None = field(
        default=None,
        metadata={"help": "Comma-separated module names to adapt; None: PEFT's default for the model type."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora_r < 1 or self.lora_alpha <= 0:
            raise ValueError(f"lora_r must be >= 1 and lora_alpha > 0, got {self.lora_r}, {self.lora_alpha}.")
