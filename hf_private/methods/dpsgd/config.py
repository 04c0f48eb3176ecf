"""`DPConfig`: plain DP-SGD on whatever the model has trainable (full fine-tuning or PEFT LoRA)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

CONFIG_NAME = "dp_config.json"


@dataclass
class DPConfig:
    """Differentially private SGD with Poisson sampling, one flat per-example clip and Gaussian noise.

    Method configs (`BitFitConfig`, ...) subclass this: they decide *which* tensors are trainable and may
    add their own ledgered mechanisms; clipping, noise and accounting stay the engine's job.
    """

    method: ClassVar[str] = "dp-sgd"

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget ε for the whole planned run. Exactly one of this and noise_multiplier."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "δ of the (ε, δ) guarantee. None means 1/(2N), always below 1/N."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ: noise std is σ·max_grad_norm. Alternative to target_epsilon (then ε is reported)."},
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Per-example clipping norm C over all trainable tensors (one flat clip)."}
    )
    accountant: str = field(
        default="prv", metadata={"help": "'prv' (tight upper bound, default) or 'rdp' (conservative)."}
    )
    noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "INSECURE test mode: seed the noise and Poisson sampling reproducibly. Anyone who knows it "
            "can remove the noise, so the guarantee is void. Leave None for real training."
        },
    )

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "Give exactly one of target_epsilon (σ is calibrated to it) and noise_multiplier (ε is reported); "
                f"got target_epsilon={self.target_epsilon}, noise_multiplier={self.noise_multiplier}."
            )
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon}.")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be > 0, got {self.noise_multiplier}: without noise there is no guarantee."
            )
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {self.target_delta}.")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm (per-example clip C) must be > 0, got {self.max_grad_norm}.")
        if self.accountant not in ("prv", "rdp"):
            raise ValueError(f"accountant must be 'prv' or 'rdp', got {self.accountant!r}.")

    def prepare_model(self, model: nn.Module) -> None:
        """Select what trains (requires_grad). DP-SGD trains whatever the user left trainable."""

    def phases(self) -> list[tuple[str, float]]:
        """(mechanism name, epochs) in order; the last phase runs to the end of training."""
        return [(self.method, float("inf"))]

    def select_phase_two(self, model: nn.Module) -> None:
        """Re-select trainable tensors when the second phase starts (two-phase methods only)."""
        raise NotImplementedError(f"{type(self).__name__} has a single phase.")

    def citations(self) -> tuple[str, ...]:
        return (
            "Abadi et al., *Deep Learning with Differential Privacy*, CCS 2016.",
            "Gopi, Lee, Wutschitz, *Numerical Composition of Differential Privacy* (PRV accountant), NeurIPS 2021.",
        )

    def resolve_delta(self, dataset_size: int) -> float:
        """δ for a dataset of this size; a δ ≥ 1/N would allow publishing one record outright."""
        delta = self.target_delta if self.target_delta is not None else 1.0 / (2 * dataset_size)
        if delta >= 1.0 / dataset_size:
            raise ValueError(
                f"target_delta={delta:g} is not below 1/N = {1.0 / dataset_size:g} for N={dataset_size}: such a δ "
                "permits leaking whole records. Use a smaller δ or leave it None for 1/(2N)."
            )
        return delta

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DPConfig:
        from hf_private.methods import config_class_for  # registry of all method configs

        data = dict(data)
        config_cls = config_class_for(data.pop("method", cls.method))
        if not issubclass(config_cls, cls):
            raise ValueError(f"Method {config_cls.method!r} is not a {cls.__name__}.")
        return config_cls(**data)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> DPConfig:
        with open(os.path.join(directory, CONFIG_NAME)) as f:
            return cls.from_dict(json.load(f))
