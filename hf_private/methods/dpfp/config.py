"""`DPFPConfig`: DP forward propagation (seed 004, methods_spec §5) — clip and noise each example's representation in
the forward pass. `mode="sound"` (default) freezes everything below the noise point and trains the head with DP-SGD, a
formal guarantee; `mode="paper"` is the published algorithm, which has none (methods_spec §6.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..base import MethodConfig

MODES = ("sound", "paper")


@dataclass
class DPFPConfig(MethodConfig):
    """DP-FP: clip and noise each example's representation in the forward pass; `mode="sound"` adds DP-SGD on the
    head for a formal ε, `mode="paper"` has none."""

    method: ClassVar[str] = "dp-fp"

    mode: str = field(
        default="sound",
        metadata={
            "help": "'sound': the encoder below the noise point is frozen and the head above it trains with "
            "DP-SGD (per-example clip + noise), so ε is a formal guarantee, labels included. 'paper': "
            "the published algorithm, the whole model trained by the plain optimizer on the noisy "
            "representation; it has NO finite guarantee (the encoder reads raw inputs, labels are "
            "unprotected), so no ε is reported, only the paper's CLT figure as an estimate."
        },
    )
    representation_clip: float = field(
        default=1.0, metadata={"help": "C of Eq. 8: each example's representation is clipped to L2 norm C."}
    )
    micro_batches: int = field(
        default=32,
        metadata={
            "help": "M: the paper's micro-batches per step of B examples. hf_private runs every micro-batch as "
            "one training step at rate B/(M·N): set the logical batch (per_device_train_batch_size × "
            "gradient_accumulation_steps) to B/M, as the recipe does."
        },
    )
    noise_point: str | None = field(
        default=None,
        metadata={
            "help": "The module whose output is the representation ('input:<name>' for its input). None: "
            "`bert.pooler` (BERT-style), `input:classifier.out_proj` (RoBERTa-style: after dense and "
            "tanh)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if not self.representation_clip > 0:
            raise ValueError(f"representation_clip must be > 0, got {self.representation_clip}.")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}.")
        if self.noise_point is not None and not self.noise_point.removeprefix("input:"):
            raise ValueError("noise_point must name a module, e.g. 'bert.pooler' or 'input:classifier.out_proj'.")
