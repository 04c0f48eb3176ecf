"""`FrostConfig`: DP-FROST (seed 000, methods_spec §2) — spend part of the budget on choosing which weight matrices
to fine-tune from noisy partition-wise gradient magnitudes, then DP-SGD on the chosen ones, in one ledger."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ..base import MethodConfig

VARIANTS = ("mgna", "mgn", "mg")


@dataclass
class FrostConfig(MethodConfig):
    """DP-FROST: part of ε chooses which weight matrices to fine-tune (noisy gradient magnitudes), the rest runs
    DP-SGD on them."""

    method: ClassVar[str] = "dp-frost"

    unfreeze_ratio: float = field(
        default=0.25**2,
        metadata={
            "help": "γ: the share of the model's parameters to select (the head, when always trained, comes on "
            "top). The paper tunes γ over {0.25, 0.25², 0.25³, 0.25⁴} on the task, which ε does not "
            "cover; 0.0625 is the middle of that grid."
        },
    )
    variant: str = field(
        default="mgna",
        metadata={
            "help": "Partition gradient magnitude: 'mgna' (normalised, absolute values; the paper's default), "
            "'mgn' (normalised) or 'mg' (raw; its sensitivity is set by the smallest partition)."
        },
    )
    norm_order: int = field(
        default=1, metadata={"help": "α: the norm of the magnitudes and of their clip, 1 (default) or 2."}
    )
    selection_rounds: int = field(
        default=5, metadata={"help": "T: PSEL rounds per selection, each a Poisson sample at selection_sample_rate."}
    )
    selection_sample_rate: float = field(
        default=0.02, metadata={"help": "q_ps: Poisson sampling rate of each selection round."}
    )
    gap_coefficient: float = field(
        default=5.0,
        metadata={
            "help": "ν: before the last round a partition is selected only if its estimated magnitude beats "
            "the frozen partitions' largest by ν standard errors."
        },
    )
    mle_iterations: int = field(
        default=1000, metadata={"help": "J: block-coordinate ascent iterations of PGM-EST (the MLE denoiser)."}
    )
    sgd_budget_ratio: float = field(
        default=0.9,
        metadata={
            "help": "r_ε: DP-SGD's σ is calibrated to r_ε·ε alone; the selection's σ then takes the rest of ε "
            "(ComputeSigma, Algorithm 3). Used with target_epsilon."
        },
    )
    num_selections: int = field(
        default=1,
        metadata={
            "help": "K: selections in all; selection k (0-based) runs before training step k·⌊U/K⌋ of the U "
            "planned steps (the paper's Table 4: K > 1 was worse)."
        },
    )
    single_shot: bool = field(
        default=False,
        metadata={
            "help": "The SINGLE ablation: one round per selection (greedy by the noisy magnitudes, no gap "
            "test), whatever selection_rounds says."
        },
    )
    always_train_head: bool = field(
        default=True,
        metadata={
            "help": "Train the new task head whatever is selected (it is not a candidate and does not count "
            "against γ). False: the head is a candidate like any partition, as in the paper, and stays "
            "at its random initialisation unless selected."
        },
    )
    skip_oversized: bool = field(
        default=False,
        metadata={
            "help": "A candidate that does not fit the round's budget is skipped and the next one tried. False "
            "(the paper): the round stops at it, so a large embedding ranked first blocks the round."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.unfreeze_ratio <= 1:
            raise ValueError(f"unfreeze_ratio γ must be in (0, 1], got {self.unfreeze_ratio}.")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}.")
        if self.norm_order not in (1, 2):
            raise ValueError(f"norm_order α must be 1 or 2, got {self.norm_order}.")
        for name in ("selection_rounds", "mle_iterations", "num_selections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not 0 < self.selection_sample_rate <= 1:
            raise ValueError(f"selection_sample_rate q_ps must be in (0, 1], got {self.selection_sample_rate}.")
        if not (math.isfinite(self.gap_coefficient) and self.gap_coefficient >= 0):
            raise ValueError(f"gap_coefficient ν must be finite and >= 0, got {self.gap_coefficient}.")
        if not 0 < self.sgd_budget_ratio < 1:
            raise ValueError(
                f"sgd_budget_ratio r_ε must be in (0, 1): the selection needs a share of ε too, got "
                f"{self.sgd_budget_ratio}."
            )

    @property
    def rounds_per_selection(self) -> int:
        return 1 if self.single_shot else self.selection_rounds
