"""`SparseLowRankConfig`: sparse + low-rank DP-SGD (seed 003, methods_spec §4) — DP-SGD on low-rank gradient factors
(PEFT LoRA, or RGP's gradient carriers) whose rows and columns for the least important units, by the L1 norms of the
weight's rows and columns, are masked before the per-example norm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..base import MethodConfig

VARIANTS = ("lora", "rgp")
MASK_SOURCES = ("pretrained", "current")
# Table 1 (SST-2) of the paper: the rank and sparsity per variant.
PAPER_RANK = {"lora": 32, "rgp": 8}
PAPER_SPARSITY = {"lora": 0.1, "rgp": 0.5}
PAPER_MASK_SOURCE = {"lora": "pretrained", "rgp": "current"}


@dataclass
class SparseLowRankConfig(MethodConfig):
    """Sparse + low-rank DP-SGD: DP-SGD on low-rank gradient factors (LoRA or RGP) whose least important rows and
    columns are masked."""

    method: ClassVar[str] = "sparse-lowrank"

    variant: str = field(
        default="lora",
        metadata={
            "help": "'lora': DP-SGD on PEFT LoRA factors of the frozen model (a standard PEFT adapter). 'rgp': "
            "the weights themselves train; each step's gradient is estimated through rank-k carriers "
            "recomputed from the current weight (reparametrized gradient perturbation)."
        },
    )
    rank: int | None = field(
        default=None, metadata={"help": "k, the rank of the factors; None: the paper's Table 1 (LoRA 32, RGP 8)."}
    )
    sparsity: float | None = field(
        default=None,
        metadata={
            "help": "p in [0, 1): the share of rows and the share of columns of each weight whose units are "
            "masked (⌊p·m⌋ rows, ⌊p·n⌋ columns with the smallest L1 norms). None: Table 1 for SST-2 "
            "(LoRA 0.1, RGP 0.5; the paper used RGP 0.1 on QNLI)."
        },
    )
    target_modules: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated names of the layers to adapt (module-name suffixes, as PEFT). None: PEFT's "
            "LoRA default for the model type (LoRA); every Linear/Conv1D of the transformer blocks "
            "(RGP, as its reference code adapts attention and FFN matrices)."
        },
    )
    mask_source: str | None = field(
        default=None,
        metadata={
            "help": "Which weight the unit importances are computed from: 'pretrained' (W0, fixed masks; the "
            "LoRA default) or 'current' (recomputed after every step from the weight so far, a DP "
            "output; the RGP default). Either is a function of weights only, so it costs no privacy."
        },
    )
    lora_alpha: float | None = field(
        default=None, metadata={"help": "LoRA scaling alpha (update scaled by alpha / k); None: alpha = k."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}.")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(f"rank must be an integer >= 1, got {self.rank!r}.")
        if self.sparsity is not None and not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity p must be in [0, 1), got {self.sparsity}.")
        if self.mask_source is not None and self.mask_source not in MASK_SOURCES:
            raise ValueError(f"mask_source must be one of {MASK_SOURCES}, got {self.mask_source!r}.")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}.")
        if self.variant == "rgp" and self.lora_alpha is not None:
            raise ValueError("lora_alpha applies to the LoRA variant only.")

    @property
    def resolved_rank(self) -> int:
        return self.rank if self.rank is not None else PAPER_RANK[self.variant]

    @property
    def resolved_sparsity(self) -> float:
        return self.sparsity if self.sparsity is not None else PAPER_SPARSITY[self.variant]

    @property
    def resolved_mask_source(self) -> str:
        return self.mask_source if self.mask_source is not None else PAPER_MASK_SOURCE[self.variant]
