"""The run's side of `hf_private.methods.base.MethodRun`, what a method may do between logical batches
(`DPMethod.before_step`): draw its own Poisson sample, collect per-example terms with a reducer of its choice, and
release a noisy vector of one of its planned stages.

The pieces that make a release private stay here, not in the method: the sample is Poisson at the stage's planned rate
from a secret generator; the noise is the stage's planned σ times the sensitivity the reducer guarantees, drawn once
from the secret noise source (on rank 0, before the sum over processes); and every release is recorded in the ledger
before the method sees it. A method only chooses what to measure and what to do with the noisy result.

The view is handed the run's pieces it needs (`PrivacyRun` builds it), so it knows nothing else of the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..engine import PerExampleGradientEngine, Reducer
from ..optimizer import noise_once_then_sum
from ..privacy import GaussianNoise, PrivacyLedger
from ..privacy.plan import PrivacyPlan
from ..privacy.rng import SecretRandom


class TrainingPasses(Protocol):
    """What a method's measurement needs of the trainer: the training data as collated, one Poisson sample of the
    privacy unit in physical chunks, and one chunked forward/backward pass into an engine (the trainer's own, so a
    method's measurement samples and sees what training does)."""

    def training_data(self) -> tuple[Any, Any]: ...

    def poisson_chunks(self, dataset: Any, sample_rate: float, random: Any) -> list[list[int]]: ...

    def record_chunks(self, model: nn.Module, inputs: dict, engine: PerExampleGradientEngine) -> torch.Tensor: ...


class MethodView:
    """A method's handle on the run (`MethodRun`): sampling, per-example terms, and the noisy release of its planned
    stages; nothing else of the run."""

    def __init__(
        self,
        model: nn.Module,
        plan: PrivacyPlan,
        passes: TrainingPasses,
        *,
        max_grad_norm: float,
        noise: GaussianNoise,
        random: SecretRandom,
        ledger: Callable[[], PrivacyLedger],
        record_release: Callable[[str], None],
        suspend_training_engine: Callable[[], None],
    ) -> None:
        """`noise` and `random`: secret streams of the method's own, apart from training's; `ledger`: the run's current
        ledger (a resume replaces it); `record_release(stage)`: one release of `stage` into it;
        `suspend_training_engine`: detach the training engine while the method's own one records."""
        self._model, self._plan, self._passes = model, plan, passes
        self._max_grad_norm, self._noise, self._random = max_grad_norm, noise, random
        self._ledger, self._record_release = ledger, record_release
        self._suspend_training_engine = suspend_training_engine

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def plan(self) -> PrivacyPlan:
        return self._plan

    def poisson_sample(self, stage: str) -> list[dict[str, Any]]:
        """This process's share of one Poisson sample of the privacy unit (examples; users under ULS) at the planned
        rate of `stage`, collated in physical chunks of per_device_train_batch_size units (none when the sample is
        empty: its release is then noise alone)."""
        dataset, collate = self._passes.training_data()
        chunks = self._passes.poisson_chunks(dataset, self.plan[stage].sample_rate, self._random)
        return [collate([dataset[i] for i in chunk]) for chunk in chunks]

    def new_engine(self, reducer: Reducer) -> PerExampleGradientEngine:
        """An engine on the currently trainable parameters that hands its terms to `reducer`; detach it when done.

        The training engine is detached first (two engines would both record), and rebuilt after `before_step`.
        """
        self._suspend_training_engine()
        engine = PerExampleGradientEngine(self.model, self._max_grad_norm, reducer=reducer)
        engine.attach()
        return engine

    def accumulate(self, engine: PerExampleGradientEngine, chunks: list[dict[str, Any]]) -> None:
        """Forward and backward every chunk in training mode, one per-example loss each, into `engine`'s reducer."""
        model = self.model
        was_training = model.training
        model.train()
        try:
            for chunk in chunks:
                self._passes.record_chunks(model, chunk, engine)
        finally:
            model.train(was_training)

    def releases(self, stage: str) -> int:
        """Releases of `stage` the ledger holds (a resumed run's included)."""
        return sum(group.steps for group in self._ledger().mechanisms if group.name == stage)

    def release(self, stage: str, values: torch.Tensor, sensitivity: float) -> torch.Tensor:
        """values + N(0, (σ_stage · sensitivity)²) per coordinate, summed over processes, recorded in the ledger.

        `sensitivity` is the L2 sensitivity of `values` under add/remove of one example (the reducer's). The σ is the
        plan's for `stage`: a method cannot pick its own.
        """
        if not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ValueError(f"The sensitivity of a release must be finite and > 0, got {sensitivity}.")
        noisy = values.detach().to(dtype=torch.promote_types(values.dtype, torch.float32), copy=True)
        std = self.plan[stage].release_noise_multiplier() * float(sensitivity)
        noise_once_then_sum([noisy], lambda tensors: self._noise.add_(tensors, std))
        self._record_release(stage)
        return noisy
