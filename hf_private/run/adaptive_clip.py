"""Adaptive clipping during a run: count the unclipped units in the engine's own clip, release the count, move C.

The analysis, the formula z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) and the update rule are `hf_private.privacy.adaptive_clip`'s;
here the `PrivacyRun` instrument that applies them (Andrew et al. 2021, Algorithm 1, in DP-SGD's setting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..engine import PerExampleGradientEngine
from ..engine.reducers import ChunkTerms, FlatL2ClipReducer
from ..optimizer import NoisyOptimizer, noise_once_then_sum
from ..privacy.adaptive_clip import (
    COUNT_SENSITIVITY,
    AdaptiveClipError,
    geometric_update,
    gradient_noise_multiplier,
    initial_clip_norm,
)
from ..privacy.events import MechanismGroup
from ..privacy.noise import GaussianNoise


class CountingClipReducer(FlatL2ClipReducer):
    """DP-SGD's flat clip, also counting Σ(b_i − ½) over the units it clipped (b_i = 1 when ‖g_i‖ ≤ C): the engine's
    own norms, so the count costs no extra pass. Reset with the clipped sums (an interrupted batch releases neither)."""

    def __init__(self, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.centred_count: torch.Tensor | None = None

    def reduce(self, chunk: ChunkTerms) -> torch.Tensor:
        clip = self.max_grad_norm
        norms = super().reduce(chunk)
        centred = (norms <= clip).sum(dtype=torch.float64) - COUNT_SENSITIVITY * norms.numel()
        self.centred_count = centred if self.centred_count is None else self.centred_count + centred
        return norms

    def pop_centred_count(self, device: torch.device) -> torch.Tensor:
        """This process's Σ(b_i − ½) since the last pop, as a 1-element float32 tensor on `device` (0 for none)."""
        count = self.centred_count
        self.centred_count = None
        if count is None:
            return torch.zeros(1, dtype=torch.float32, device=device)
        return count.to(device=device, dtype=torch.float32).reshape(1)

    def reset(self) -> None:
        super().reset()
        self.centred_count = None


class AdaptiveClip:
    """The run's adaptive clip norm (see the module docstring): a `PrivacyRun` instrument that installs the counting
    reducer on every training engine and, at each step's end, releases the noisy count and moves C.

    `on_clip(C)` is called with every new C (the run sets it on its engine, optimizer and itself).
    """

    def __init__(
        self,
        config: Any,
        noise_multiplier: float,
        expected_batch_size: float,
        noise: GaussianNoise,
        on_clip: Callable[[float], None],
    ) -> None:
        self.target_quantile = float(config.target_quantile)
        self.learning_rate = float(config.clip_learning_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.count_noise_std = float(config.clip_count_noise) * self.expected_batch_size
        self.noise_multiplier = float(noise_multiplier)
        self.gradient_noise_multiplier = gradient_noise_multiplier(self.noise_multiplier, self.count_noise_std)
        self.initial = self.clip = self.last_used = initial_clip_norm(config)
        self.lowest = self.highest = self.clip
        self.updates = 0
        self.noise, self._on_clip = noise, on_clip

    # ------------------------------------------------------------------ instrument
    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        if type(engine.reducer) is FlatL2ClipReducer:
            engine.reducer = CountingClipReducer(engine.max_grad_norm)
        elif not isinstance(engine.reducer, CountingClipReducer):
            raise AdaptiveClipError(
                f"Adaptive clipping counts the units DP-SGD's flat clip leaves unclipped, but this engine's reducer is "
                f"a {type(engine.reducer).__name__}: use a fixed max_grad_norm with this method."
            )

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        optimizer.add_step_end_hook(lambda: self.after_step(optimizer))

    def after_step(self, optimizer: NoisyOptimizer) -> None:
        """Release this step's noisy centred count (noised once over all processes) and move C."""
        reducer = optimizer.engine.reducer
        if not isinstance(reducer, CountingClipReducer):
            raise AdaptiveClipError("The training engine lost its counting reducer: the count cannot be released.")
        device = next((p.device for _, p in optimizer.engine.parameters), torch.device("cpu"))
        count = [reducer.pop_centred_count(device)]
        noise_once_then_sum(count, lambda tensors: self.noise.add_(tensors, self.count_noise_std))
        self.update(float(count[0].item()) / self.expected_batch_size + COUNT_SENSITIVITY)

    def update(self, noisy_unclipped_fraction: float) -> float:
        """Move C by the geometric rule from a released (noisy) unclipped fraction b̃; returns the new C."""
        self.last_used = self.clip
        self.set_clip(geometric_update(self.clip, noisy_unclipped_fraction, self.target_quantile, self.learning_rate))
        self.updates += 1
        return self.clip

    def set_clip(self, clip: float) -> None:
        self.clip = float(clip)
        self.lowest, self.highest = min(self.lowest, self.clip), max(self.highest, self.clip)
        self._on_clip(self.clip)

    # ------------------------------------------------------------------ ledger, report, checkpoints
    def release_facts(self) -> dict[str, float]:
        """What the ledger event of a step records beside its effective σ: the parts of the joint release."""
        return {
            "gradient_noise_multiplier": self.gradient_noise_multiplier,
            "count_noise_std": self.count_noise_std,
            "count_sensitivity": COUNT_SENSITIVITY,
            "target_quantile": self.target_quantile,
            "clip_learning_rate": self.learning_rate,
        }

    def event(self, base: MechanismGroup) -> MechanismGroup:
        """A training step's event: one Poisson-subsampled Gaussian at the effective z, C left out (it changes every
        step: the log history has it), the joint release's parts in `adaptive_clip`."""
        return replace(base, max_grad_norm=None, adaptive_clip=self.release_facts())

    def report(self) -> dict[str, Any]:
        """The card's `adaptive_clipping` facts: where C started and ended, and the joint release's noise."""
        return {
            "initial_max_grad_norm": self.initial,
            "final_max_grad_norm": self.clip,
            "lowest_max_grad_norm": self.lowest,
            "highest_max_grad_norm": self.highest,
            "updates": self.updates,
            "noise_multiplier": self.noise_multiplier,
            **self.release_facts(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Released values only (C is a function of the noisy counts): what a resumed run continues from."""
        return {
            "initial": self.initial,
            "current": self.clip,
            "last_used": self.last_used,
            "lowest": self.lowest,
            "highest": self.highest,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial, self.updates = float(state["initial"]), int(state["updates"])
        self.last_used = float(state["last_used"])
        self.lowest, self.highest = float(state["lowest"]), float(state["highest"])
        self.set_clip(float(state["current"]))
