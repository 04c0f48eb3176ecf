"""What a method may do between logical batches (`DPMethod.before_step`): draw its own Poisson sample, collect
per-example terms with a reducer of its choice, and release a noisy vector of one of its planned stages.

The pieces that make a release private stay here, not in the method: the sample is Poisson at the stage's planned rate
from a secret generator; the noise is the stage's planned σ times the sensitivity the reducer guarantees, drawn once
from the secret noise source (on rank 0, before the sum over processes); and every release is recorded in the ledger
before the method sees it. A method only chooses what to measure and what to do with the noisy result.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..engine import PerExampleGradientEngine
from ..engine.reducers import Reducer
from ..optimizer import noise_once_then_sum
from ..privacy.plan import PrivacyPlan

if TYPE_CHECKING:
    from .privacy_run import PrivacyRun, TrainingSteps


class MethodRun:
    """A method's handle on the run (`hf_private.run.privacy_run.PrivacyRun`): sampling, per-example terms, and the
    noisy release
    of its planned stages; nothing else of the run."""

    def __init__(self, run: PrivacyRun, steps: TrainingSteps) -> None:
        self._run, self._steps = run, steps
        self._noise = run.noise("method noise")  # streams of their own, apart from training's
        self._random = run.sampling_random("method sampling")

    @property
    def model(self) -> nn.Module:
        return self._run.model

    @property
    def plan(self) -> PrivacyPlan:
        return self._run.plan

    def poisson_sample(self, stage: str) -> list[dict[str, Any]]:
        """This process's share of one Poisson sample of the privacy unit (examples; users under ULS) at the planned
        rate of `stage`, collated in physical chunks of per_device_train_batch_size units (none when the sample is
        empty: its release is then noise alone)."""
        dataset, collate = self._steps.training_data()
        chunks = self._steps.poisson_chunks(dataset, self.plan[stage].sample_rate, self._random)
        return [collate([dataset[i] for i in chunk]) for chunk in chunks]

    def new_engine(self, reducer: Reducer) -> PerExampleGradientEngine:
        """An engine on the currently trainable parameters that hands its terms to `reducer`; detach it when done.

        The training engine is detached first (two engines would both record), and rebuilt after `before_step`.
        """
        self._run.suspend_training_engine()
        engine = PerExampleGradientEngine(self.model, self._run.max_grad_norm, reducer=reducer)
        engine.attach()
        return engine

    def accumulate(self, engine: PerExampleGradientEngine, chunks: list[dict[str, Any]]) -> None:
        """Forward and backward every chunk in training mode, one per-example loss each, into `engine`'s reducer."""
        model = self.model
        was_training = model.training
        model.train()
        try:
            for chunk in chunks:
                self._steps.record_chunks(model, chunk, engine)
        finally:
            model.train(was_training)

    def releases(self, stage: str) -> int:
        """Releases of `stage` the ledger holds (a resumed run's included)."""
        return sum(group.steps for group in self._run.ledger.mechanisms if group.name == stage)

    def release(self, stage: str, values: torch.Tensor, sensitivity: float) -> torch.Tensor:
        """values + N(0, (σ_stage · sensitivity)²) per coordinate, summed over processes, recorded in the ledger.

        `sensitivity` is the L2 sensitivity of `values` under add/remove of one example (the reducer's). The σ is the
        plan's for `stage`: a method cannot pick its own.
        """
        if not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ValueError(f"The sensitivity of a release must be finite and > 0, got {sensitivity}.")
        noisy = values.detach().to(dtype=torch.promote_types(values.dtype, torch.float32), copy=True)
        std = self.plan[stage].noise_multiplier * float(sensitivity)
        noise_once_then_sum([noisy], lambda tensors: self._noise.add_(tensors, std))
        self._run.record_release(stage)
        return noisy
