"""The privacy plan: q, steps and δ of a run, its stages, and the noise of every stage calibrated against one target.

A method describes the data-dependent mechanisms it will release as `Stage`s (DP-SGD: one; X+BiTFiT: two that
share σ and q; DP-FROST: the selection rounds at their own rate, then DP-SGD), and `PrivacyPlan` turns them into
numbers before training starts:

* q = expected batch / N, planned steps (given, or ⌈epochs · steps per epoch⌉), δ (None → 1/(2N); ≥ 1/N refused);
* the schedule: the steps of every stage, and the training step at which each *training* stage starts (stages
  that run outside the optimizer steps, like DP-FROST's selection, have no start step);
* each stage's σ, so that the composition of all stages spends ε ≤ target under the accountant:

  1. stages with a fixed `noise_multiplier` are taken as they are;
  2. stages with an `epsilon_share` r are calibrated one after the other, in increasing r, each to r · target on
     top of the fixed stages and the shares already calibrated (DP-FROST's ComputeSigma, methods_spec §2.7:
     σ_SGD for r_ε · ε alone, then σ_ps for ε with σ_SGD fixed);
  3. every other stage has a `noise_ratio` ρ (default 1), and one scalar s is calibrated so that everything,
     with σ_i = ρ_i · s, spends ε ≤ target (`calibration.calibrate_jointly`). One stage, or stages with the same
     ratio and rate (X+BiTFiT), get exactly `calibrate_noise_multiplier`'s σ for the whole planned run.

  Without a target (a fixed `noise_multiplier` for the run), σ_i = ρ_i · noise_multiplier and ε is what it is.

Every ε here is the accountant's at δ − δ_tail, where δ_tail is what the noise sampler's finite tail costs
(`accountants.sampler_tail_delta`, `rng.tail_mass`). δ_tail depends on σ, so each σ the calibration tries is
checked at its own δ − δ_tail(σ): ε still falls as σ grows (δ_tail shrinks with σ), so the searches stay valid,
and the σ returned meets the target at the δ_tail of the planned run. Compared with calibrating at δ, σ can only
grow. A plan whose δ_tail would exceed δ/10 is refused: that is the floor on σ, below which the tail grows fast
(4.5e-12 per release at σ = 0.4, 1e-9 at σ = 0.3, 7e-6 at σ = 0.2).

A stage may be user-level by example-level sampling (ELS): `Stage(examples_per_user=k)`. Its releases sample
*examples* at q from data where every user has at most k examples, and its events are `"els_poisson_gaussian"`
events carrying k; σ is calibrated (or checked) on their ε exactly as for the other stages, by the same searches
(`accountants` says how ε of such a history is computed). k = 1 gives the numbers of example-level DP-SGD.

A training stage may be amplified BandMF: `Stage(bands=b, sample_rate=q̂)`, q̂ = b·B/N the rate within one of
the b partitions. Its events are `"band_mf"` events, ⌈steps/b⌉ Poisson-Gaussian releases (q̂, σ) for the accountant,
and σ is calibrated and the budget stopped on their ε by the same searches.

A stage may be marked `no_guarantee` with a reason (DP-FP in paper mode): it is never calibrated, the plan's ε is
∞, its `guarantee` is ("none", reason), the budget stop does not apply, and its ledger events are
`"no_guarantee"` events, so the report says `guarantee: none` for that reason.

The ledger events of a stage come from `PrivacyPlan.event`; `PrivacyPlan.max_training_steps` is the budget stop:
how many more training steps the target allows after what the ledger holds, following the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..logs import get_logger
from .accountants import check_accountant, compute_epsilon, sampler_tail_delta
from .calibration import (
    BudgetError,
    JointMechanism,
    calibrate_jointly,
    calibrate_noise_multiplier,
    max_steps_within,
)
from .events import (
    BAND_INV_MF,
    BAND_MF,
    ELS_POISSON_GAUSSIAN,
    NO_GUARANTEE,
    POISSON_GAUSSIAN,
    MechanismGroup,
    gaussian_event,
)
from .rng import Z_MAX

logger = get_logger(__name__)

# The budget stop searches this far past the planned steps (as calibration.max_steps_within's default).
_UNBOUNDED_STEPS = 10**7
# The most of δ a plan lets the noise sampler's finite tail take: the floor on σ.
TAIL_SHARE = 0.1


def check_budget(target_epsilon: float | None, noise_multiplier: float | None) -> None:
    """Exactly one of target_epsilon (> 0) and noise_multiplier (finite, > 0): the rule of a DP config and of a plan."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError(
            "Give exactly one of target_epsilon (σ is calibrated to it) and noise_multiplier (ε is reported); "
            f"got target_epsilon={target_epsilon}, noise_multiplier={noise_multiplier}."
        )
    if target_epsilon is not None and not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}.")
    if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(
            f"noise_multiplier must be finite and > 0, got {noise_multiplier}: without noise there is no guarantee."
        )


def check_target_delta(delta: float | None) -> None:
    """A δ given by the user lies in (0, 1) (None: 1/(2N) once N is known, see `resolve_delta`)."""
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {delta}.")


def resolve_delta(dataset_size: int, delta: float | None = None) -> float:
    """δ for a dataset of N examples: None → 1/(2N); a δ ≥ 1/N (it would allow publishing one record) is refused."""
    if int(dataset_size) != dataset_size or dataset_size < 1:
        raise ValueError(f"dataset_size must be a positive integer, got {dataset_size}.")
    check_target_delta(delta)
    resolved = float(delta) if delta is not None else 1.0 / (2 * dataset_size)
    if resolved >= 1.0 / dataset_size:
        raise ValueError(
            f"target_delta={resolved:g} is not below 1/N = {1.0 / dataset_size:g} for N={dataset_size}: such a δ "
            "permits leaking whole records. Use a smaller δ or leave it None for 1/(2N)."
        )
    return resolved


def check_expected_batch(expected_batch_size: int, dataset_size: int) -> None:
    """The expected logical batch is a positive integer no larger than N (q = batch / N ≤ 1)."""
    if int(expected_batch_size) != expected_batch_size or expected_batch_size < 1:
        raise ValueError(f"expected_batch_size must be a positive integer, got {expected_batch_size}.")
    if expected_batch_size > dataset_size:
        raise ValueError(
            f"Expected logical batch {expected_batch_size} (per_device_train_batch_size × "
            f"gradient_accumulation_steps × world_size) exceeds the dataset size {dataset_size}."
        )


def _sigma_floor(events: Sequence[MechanismGroup], delta: float) -> float | None:
    """The smallest σ (within 0.1%) at which `events`, all at that σ, leave the sampler tail at most TAIL_SHARE·δ,
    or None when no σ up to 10⁶ does (part of the tail does not shrink with 1/σ).

    Only the releases count for a Poisson-subsampled Gaussian; an ELS event's tail also depends on its q and k."""
    releases = sum(e.steps for e in events if e.examples_per_user is None)
    els = [(e.sample_rate, e.examples_per_user, e.steps) for e in events if e.examples_per_user is not None]

    def fits(sigma: float) -> bool:
        probe = [MechanismGroup("floor", sigma, 1.0, releases)] + [
            MechanismGroup.els("floor", sigma, q, k, steps) for q, k, steps in els
        ]
        return sampler_tail_delta(probe, delta) <= TAIL_SHARE * delta

    low, high = 1e-2, 1e6
    if not fits(high):
        return None
    while high / low > 1.001:  # bisection in log σ: the tail decreases as σ grows
        middle = math.sqrt(low * high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def steps_per_epoch(sample_rate: float) -> int:
    """Steps that visit N examples in expectation: round(1/q), at least one (`sampling.expected_steps_per_epoch`)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
    return max(1, round(1.0 / sample_rate))


@dataclass(frozen=True)
class Stage:
    """One data-dependent mechanism a method releases: a Poisson-subsampled Gaussian (or a release with no
    guarantee), `steps` times, at a sampling rate, with its noise fixed or calibrated by the plan."""

    name: str = field(metadata={"help": "Mechanism name, as the ledger and the card show it (unique in a plan)."})
    sample_rate: float | None = field(
        default=None, metadata={"help": "Poisson rate q of this stage; None: the training rate expected batch / N."}
    )
    steps: int | None = field(
        default=None,
        metadata={
            "help": "Releases of this stage. For a training stage, at most what the plan has left; give at "
            "most one of steps and epochs, and neither for the last training stage to run to the end."
        },
    )
    epochs: float | None = field(
        default=None,
        metadata={"help": "Alternative to steps: round(epochs · round(1/q)) releases at this stage's rate q."},
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "A fixed σ for this stage (not calibrated; counted against the target)."}
    )
    noise_ratio: float | None = field(
        default=None,
        metadata={
            "help": "σ = noise_ratio · s, with the one scale s calibrated jointly for all ratio stages "
            "(default 1 when neither noise_multiplier nor epsilon_share is given)."
        },
    )
    epsilon_share: float | None = field(
        default=None,
        metadata={
            "help": "Calibrate this stage alone, before the ratio stages, so that it and every share stage "
            "with a smaller share spend ε ≤ epsilon_share · target (DP-FROST's r_ε)."
        },
    )
    training: bool = field(
        default=True,
        metadata={
            "help": "True: one release per optimizer step, in schedule order. False: released by the method "
            "outside the optimizer steps (DP-FROST's selection rounds); not a training step."
        },
    )
    sensitivity: str = field(
        default="", metadata={"help": "What the noise is scaled to, for logs and the card (e.g. 'flat L2 clip C')."}
    )
    no_guarantee: str | None = field(
        default=None,
        metadata={
            "help": "Why this release has no finite guarantee (e.g. DP-FP paper mode). ε becomes ∞; the stage "
            "is never calibrated and its events are 'no_guarantee' events."
        },
    )
    examples_per_user: int | None = field(
        default=None,
        metadata={
            "help": "User-level DP by example-level sampling (ELS): every user has at most this many examples "
            "k, examples are Poisson-sampled at q; the stage's events are 'els_poisson_gaussian' events "
            "with k, accounted as a mixture of Gaussians. None: example-level (one unit, one term)."
        },
    )
    bands: int | None = field(
        default=None,
        metadata={
            "help": "Amplified BandMF (`band_mf`): b-banded correlated noise, partition t mod b sampled at this "
            "stage's rate q̂; the stage's events are 'band_mf' events with b, accounted as ⌈steps/b⌉ "
            "Poisson-subsampled Gaussian releases (q̂, σ). None: independent noise (DP-SGD)."
        },
    )
    banded_inverse: bool = field(
        default=False,
        metadata={
            "help": "With `bands`: banded-inverse MF (`band_inv_mf`, BISR) instead of BandMF; its events are "
            "'band_inv_mf' events, one un-amplified Gaussian at σ / sensitivity (`privacy.banded_inverse`)."
        },
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("A stage needs a name (e.g. 'dp-sgd').")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"Stage {self.name!r}: sample_rate must be in (0, 1], got {self.sample_rate}.")
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"Stage {self.name!r}: give steps or epochs, not both.")
        if self.steps is not None and (int(self.steps) != self.steps or self.steps < 0):
            raise ValueError(f"Stage {self.name!r}: steps must be a non-negative integer, got {self.steps}.")
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs >= 0):
            raise ValueError(f"Stage {self.name!r}: epochs must be finite and >= 0, got {self.epochs}.")
        if not self.training and self.steps is None and self.epochs is None:
            raise ValueError(f"Stage {self.name!r} runs outside training steps: give its steps (or epochs).")
        noise = [k for k in ("noise_multiplier", "noise_ratio", "epsilon_share") if getattr(self, k) is not None]
        if len(noise) > 1:
            raise ValueError(f"Stage {self.name!r}: give at most one of {', '.join(noise)}.")
        if self.noise_multiplier is not None and not (
            math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0
        ):
            raise ValueError(
                f"Stage {self.name!r}: noise_multiplier must be finite and > 0, got {self.noise_multiplier}."
            )
        if self.noise_ratio is not None and not (math.isfinite(self.noise_ratio) and self.noise_ratio > 0):
            raise ValueError(f"Stage {self.name!r}: noise_ratio must be finite and > 0, got {self.noise_ratio}.")
        if self.epsilon_share is not None and not 0 < self.epsilon_share <= 1:
            raise ValueError(f"Stage {self.name!r}: epsilon_share must be in (0, 1], got {self.epsilon_share}.")
        if self.no_guarantee is not None and not (isinstance(self.no_guarantee, str) and self.no_guarantee.strip()):
            raise ValueError(f"Stage {self.name!r}: no_guarantee must be the reason, a non-empty string.")
        if self.no_guarantee is not None and self.epsilon_share is not None:
            raise ValueError(f"Stage {self.name!r} has no guarantee: it cannot take a share of ε.")
        if self.examples_per_user is not None:
            k = self.examples_per_user
            if isinstance(k, bool) or int(k) != k or k < 1:
                raise ValueError(f"Stage {self.name!r}: examples_per_user must be a positive integer, got {k!r}.")
            if self.no_guarantee is not None:
                raise ValueError(f"Stage {self.name!r} has no guarantee: it has no ELS accounting (examples_per_user).")
            object.__setattr__(self, "examples_per_user", int(k))
        if self.bands is not None:
            b = self.bands
            if isinstance(b, bool) or int(b) != b or b < 1:
                raise ValueError(f"Stage {self.name!r}: bands must be a positive integer, got {b!r}.")
            if self.no_guarantee is not None or self.examples_per_user is not None or not self.training:
                raise ValueError(
                    f"Stage {self.name!r}: bands (BandMF) is for a training stage with a guarantee at example level."
                )
            object.__setattr__(self, "bands", int(b))
        if self.banded_inverse and self.bands is None:
            raise ValueError(f"Stage {self.name!r}: banded_inverse needs bands.")

    def event(
        self, noise_multiplier: float, sample_rate: float, steps: int, max_grad_norm: float | None = None
    ) -> MechanismGroup:
        """The ledger event of `steps` noised releases of this stage at (σ, q): ELS when `examples_per_user` is set,
        BandMF when `bands` is."""
        return gaussian_event(
            self.name,
            noise_multiplier,
            sample_rate,
            steps,
            max_grad_norm,
            self.examples_per_user,
            self.bands,
            self.banded_inverse,
        )

    @property
    def calibration(self) -> str:
        """'none' (no guarantee), 'fixed', 'share' or 'ratio': how the plan sets this stage's σ."""
        if self.no_guarantee is not None:
            return "none"
        if self.noise_multiplier is not None:
            return "fixed"
        if self.epsilon_share is not None:
            return "share"
        return "ratio"


@dataclass(frozen=True)
class PlannedStage:
    """A stage with its numbers: rate q, steps, start step (training stages only) and σ.

    σ is None only when it is undefined: a no-guarantee stage without a fixed σ, or a calibrated stage that has
    no steps (nor anything sharing its scale).
    """

    stage: Stage
    sample_rate: float
    steps: int
    start_step: int | None
    noise_multiplier: float | None

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def training(self) -> bool:
        return self.stage.training

    @property
    def end_step(self) -> int | None:
        return None if self.start_step is None else self.start_step + self.steps

    def training_span(self) -> tuple[int, int]:
        """(start, end): the 0-based training steps start ≤ step < end of a training stage, which always has them;
        ValueError for a stage outside the training steps."""
        if self.start_step is None:
            raise ValueError(f"Stage {self.name!r} runs outside the training steps: it has no training span.")
        return self.start_step, self.start_step + self.steps

    def release_noise_multiplier(self) -> float:
        """σ of this stage's noised releases; ValueError where it is undefined (a stage planned with no steps)."""
        if self.noise_multiplier is None:
            raise ValueError(f"Stage {self.name!r} has no σ (it was planned with no steps).")
        return self.noise_multiplier

    def event(self, steps: int, max_grad_norm: float | None = None) -> MechanismGroup:
        """The ledger event of `steps` releases of this stage."""
        if self.stage.no_guarantee is not None:
            return MechanismGroup.no_guarantee(self.name, self.stage.no_guarantee, steps, max_grad_norm)
        return self.stage.event(self.release_noise_multiplier(), self.sample_rate, steps, max_grad_norm)

    def to_dict(self) -> dict[str, Any]:
        if self.stage.no_guarantee is not None:
            mechanism = NO_GUARANTEE
        elif self.stage.bands is not None:
            mechanism = BAND_INV_MF if self.stage.banded_inverse else BAND_MF
            if self.stage.banded_inverse and self.stage.bands == 1:
                mechanism = POISSON_GAUSSIAN  # C = I: DP-SGD
        else:
            mechanism = POISSON_GAUSSIAN if self.stage.examples_per_user is None else ELS_POISSON_GAUSSIAN
        d: dict[str, Any] = {
            "name": self.name,
            "mechanism": mechanism,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "training": self.training,
            "start_step": self.start_step,
            "noise_multiplier": self.noise_multiplier,
            "calibration": self.stage.calibration,
        }
        if self.stage.sensitivity:
            d["sensitivity"] = self.stage.sensitivity
        if self.stage.no_guarantee is not None:
            d["reason"] = self.stage.no_guarantee
        if self.stage.examples_per_user is not None:
            d["examples_per_user"] = self.stage.examples_per_user
        if self.stage.bands is not None:
            d["bands"] = self.stage.bands
        return d


class PrivacyPlan:
    """q, steps, δ and every stage's σ for one run on `dataset_size` examples (see the module docstring).

    Give `steps` or `epochs` (the planned training steps: `steps`, or ⌈epochs · round(1/q)⌉, as the trainer
    plans them), and `target_epsilon` or `noise_multiplier`. `stages` default to one DP-SGD stage named `name`.
    `tolerance` and `max_noise_multiplier` are the calibration's (`calibrate_noise_multiplier`).
    """

    def __init__(
        self,
        dataset_size: int,
        expected_batch_size: int,
        *,
        steps: int | None = None,
        epochs: float | None = None,
        delta: float | None = None,
        accountant: str = "prv",
        target_epsilon: float | None = None,
        noise_multiplier: float | None = None,
        stages: Sequence[Stage] | None = None,
        name: str = "dp-sgd",
        tolerance: float = 0.01,
        max_noise_multiplier: float = 1000.0,
    ) -> None:
        check_accountant(accountant)
        self.delta = resolve_delta(dataset_size, delta)
        self.dataset_size = int(dataset_size)
        check_expected_batch(expected_batch_size, dataset_size)
        self.expected_batch_size = int(expected_batch_size)
        self.sample_rate = self.expected_batch_size / self.dataset_size
        self.steps_per_epoch = steps_per_epoch(self.sample_rate)
        if steps is not None and epochs is None:
            if int(steps) != steps or steps < 1:
                raise ValueError(f"steps must be a positive integer, got {steps}.")
            self.planned_steps = int(steps)
        elif epochs is not None and steps is None:
            if not (math.isfinite(epochs) and epochs > 0):
                raise ValueError(f"epochs must be finite and > 0, got {epochs}.")
            self.planned_steps = math.ceil(epochs * self.steps_per_epoch)
        else:
            raise ValueError(f"Give exactly one of steps and epochs, got steps={steps}, epochs={epochs}.")
        check_budget(target_epsilon, noise_multiplier)
        self.accountant = accountant
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.tolerance = tolerance
        self.max_noise_multiplier = max_noise_multiplier
        self.stages: tuple[Stage, ...] = tuple(stages) if stages is not None else (Stage(name),)
        self._check_stages()
        layout = self._layout()
        sigmas = self._calibrate(layout)
        self.planned: tuple[PlannedStage, ...] = tuple(
            PlannedStage(stage, q, k, start, sigma) for (stage, q, k, start), sigma in zip(layout, sigmas)
        )
        self.scale = self._scale  # the jointly calibrated s of the ratio stages (None when there are none)
        self._epsilon: float | None = None
        if self.has_guarantee:
            self._check_sampler_tail()

    # ------------------------------------------------------------------ construction
    def _check_stages(self) -> None:
        if not self.stages:
            raise ValueError("A plan needs at least one stage.")
        if not all(isinstance(stage, Stage) for stage in self.stages):
            raise TypeError("stages must be Stage objects.")
        names = [stage.name for stage in self.stages]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Stage names must be unique (the ledger tells stages apart by name): {duplicates}.")
        training = [stage for stage in self.stages if stage.training]
        if not training:
            raise ValueError("A plan needs at least one training stage (training=True).")
        open_ended = [s.name for s in training if s.steps is None and s.epochs is None]
        if open_ended and open_ended != [training[-1].name]:
            raise ValueError(
                f"Only the last training stage may leave its steps open (it runs to the end); open: {open_ended}."
            )
        shares = [s.epsilon_share for s in self.stages if s.epsilon_share is not None]
        if len(set(shares)) != len(shares):
            raise ValueError(f"epsilon_share values must differ (each is calibrated on top of the smaller): {shares}.")
        if self.target_epsilon is None and shares:
            raise ValueError(
                "epsilon_share needs target_epsilon; with a fixed noise_multiplier, give those stages their own "
                "noise_multiplier (or a noise_ratio)."
            )
        if shares and max(shares) == 1 and any(s.calibration == "ratio" for s in self.stages):
            raise ValueError("A stage with epsilon_share=1 takes the whole target, so no ratio stage can follow it.")

    def _stage_steps(self, stage: Stage, sample_rate: float) -> int | None:
        if stage.steps is not None:
            return int(stage.steps)
        if stage.epochs is not None:
            return round(stage.epochs * steps_per_epoch(sample_rate))
        return None

    def _layout(self) -> list[tuple[Stage, float, int, int | None]]:
        """(stage, q, steps, start step) for every stage; training stages fill the planned steps in order."""
        layout: list[tuple[Stage, float, int, int | None]] = []
        position = 0
        for stage in self.stages:
            q = self.sample_rate if stage.sample_rate is None else float(stage.sample_rate)
            given = self._stage_steps(stage, q)
            if not stage.training:
                assert given is not None  # Stage.__post_init__: a stage outside training gives its steps or epochs
                layout.append((stage, q, given, None))
                continue
            left = self.planned_steps - position
            k = left if given is None else min(given, left)
            layout.append((stage, q, k, position))
            position += k
        if position < self.planned_steps:
            raise ValueError(
                f"The training stages cover {position} of the {self.planned_steps} planned steps: leave the last "
                "one's steps open (steps=None, epochs=None) so it runs to the end."
            )
        return layout

    def _calibrate(self, layout: list[tuple[Stage, float, int, int | None]]) -> list[float | None]:
        sigmas: list[float | None] = [None] * len(layout)
        self._scale: float | None = None
        ratio = [i for i, (stage, *_) in enumerate(layout) if stage.calibration == "ratio"]
        if self.noise_multiplier is not None:  # a fixed σ for the run, no target (check_budget): ratio stages scale it
            self._scale = self.noise_multiplier
            for i, (stage, *_) in enumerate(layout):
                if stage.noise_multiplier is not None:  # a "fixed" stage, or a "none" one with its own σ
                    sigmas[i] = float(stage.noise_multiplier)
                elif stage.calibration == "ratio":
                    sigmas[i] = (stage.noise_ratio or 1.0) * self.noise_multiplier
            return sigmas
        target = self.target_epsilon
        assert target is not None  # check_budget: exactly one of target_epsilon and noise_multiplier
        prior: list[MechanismGroup] = []
        for i, (stage, q, k, _) in enumerate(layout):
            if stage.noise_multiplier is not None:
                fixed = sigmas[i] = float(stage.noise_multiplier)
                if stage.calibration == "fixed" and k > 0:
                    prior.append(stage.event(fixed, q, k))
        # The "share" stages, in increasing share (shares differ, _check_stages).
        shares = sorted(
            (stage.epsilon_share, i) for i, (stage, *_) in enumerate(layout) if stage.epsilon_share is not None
        )
        for share, i in shares:
            stage, q, k, _ = layout[i]
            if k == 0:
                continue
            calibrated = sigmas[i] = calibrate_noise_multiplier(
                share * target,
                self.delta,
                q,
                k,
                accountant=self.accountant,
                prior=prior,
                name=stage.name,
                tolerance=self.tolerance,
                max_noise_multiplier=self.max_noise_multiplier,
                examples_per_user=stage.examples_per_user,
                bands=stage.bands,
                banded_inverse=stage.banded_inverse,
            )
            prior.append(stage.event(calibrated, q, k))
        joint = [
            JointMechanism(
                layout[i][0].name,
                layout[i][0].noise_ratio or 1.0,
                layout[i][1],
                layout[i][2],
                layout[i][0].examples_per_user,
                layout[i][0].bands,
                layout[i][0].banded_inverse,
            )
            for i in ratio
        ]
        if any(m.steps > 0 for m in joint):
            self._scale = calibrate_jointly(
                target,
                self.delta,
                joint,
                accountant=self.accountant,
                prior=prior,
                tolerance=self.tolerance,
                max_noise_multiplier=self.max_noise_multiplier,
            )
            for i, m in zip(ratio, joint):
                sigmas[i] = m.noise_ratio * self._scale
        elif not self.has_guarantee:
            pass  # ε is ∞ whatever the noise: nothing to check against the target
        else:
            epsilon = compute_epsilon(prior, self.delta, self.accountant)
            if epsilon > target:
                raise BudgetError(
                    f"The stages with fixed noise spend ε={epsilon:.4g} > target ε={target:.4g}: "
                    "give them more noise, fewer steps or smaller rates, or allow a larger ε."
                )
        return sigmas

    def _check_sampler_tail(self) -> None:
        """Refuse a plan whose noise sampler tail would take more than TAIL_SHARE of δ (the floor on σ)."""
        events = self.planned_events()
        tail = sampler_tail_delta(events, self.delta)
        if tail <= TAIL_SHARE * self.delta:
            return
        sigmas = ", ".join(f"{e.name}: σ={e.noise_multiplier:.4g}, {e.steps} releases" for e in events)
        floor = _sigma_floor(events, self.delta)
        if floor is None:
            fix = (
                "No σ would do: over this many releases the part that does not shrink with σ (the restriction "
                "to the discs, for up to 2³² coordinates per release) is too large alone. Plan fewer steps (a "
                "larger batch, fewer epochs)"
            )
        elif self.target_epsilon is None:
            fix = f"Every σ ≥ {floor:.3g} would do: raise noise_multiplier, or plan fewer steps"
        else:
            fix = (
                f"Every σ ≥ {floor:.3g} would do. To raise σ: a smaller target ε, a larger expected batch (a "
                "larger q) or more epochs (a larger target ε or a smaller batch lowers σ and makes this worse)"
            )
        raise BudgetError(
            f"The noise sampler's finite tail would take δ_tail={tail:.3g} of δ={self.delta:.3g}, more than "
            f"{TAIL_SHARE:g}·δ ({sigmas}): the sampler never draws beyond {Z_MAX:.3f} std, so at small σ a "
            f"neighbouring dataset's output can land where this one's cannot (rng.tail_mass). {fix}; a larger δ "
            "(still below 1/N) also leaves more room."
        )

    # ------------------------------------------------------------------ what the trainer reads
    @property
    def has_guarantee(self) -> bool:
        return all(stage.no_guarantee is None for stage in self.stages)

    @property
    def guarantee(self) -> tuple[str, str | None]:
        """("formal", None), or ("none", reason) when a stage has no finite guarantee (as `PrivacyLedger.guarantee`)."""
        reasons = [f"{s.name}: {s.no_guarantee}" for s in self.stages if s.no_guarantee is not None]
        if not reasons:
            return "formal", None
        return "none", "No finite (ε, δ) guarantee: " + " ".join(reasons)

    def __getitem__(self, name: str) -> PlannedStage:
        for planned in self.planned:
            if planned.name == name:
                return planned
        raise KeyError(f"No stage {name!r} in this plan; stages: {[p.name for p in self.planned]}.")

    @property
    def training_stages(self) -> tuple[PlannedStage, ...]:
        return tuple(p for p in self.planned if p.training)

    @property
    def start_steps(self) -> dict[str, int]:
        """Training stage name → the 0-based training step at which it starts."""
        return {p.name: p.training_span()[0] for p in self.training_stages}

    def stage_at(self, step: int) -> PlannedStage:
        """The training stage of 0-based training step `step`; past the plan, the last training stage."""
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step}.")
        stages = self.training_stages
        for planned in stages:
            start, end = planned.training_span()
            if start <= step < end:
                return planned
        return stages[-1]

    def event(self, name: str, steps: int = 1, max_grad_norm: float | None = None) -> MechanismGroup:
        """The typed ledger event of `steps` releases of stage `name` (record it with `ledger.record_event`)."""
        return self[name].event(steps, max_grad_norm)

    def training_steps(self, mechanisms: Sequence[MechanismGroup]) -> int:
        """Training steps a ledger holds: its releases of this plan's training stages (not selection rounds etc.)."""
        names = {p.name for p in self.training_stages}
        return sum(group.steps for group in mechanisms if group.name in names)

    def planned_events(self) -> list[MechanismGroup]:
        """Every stage's releases as planned: what `epsilon` composes."""
        return [p.event(p.steps) for p in self.planned if p.steps > 0]

    def epsilon(self) -> float:
        """ε of the whole plan under its accountant (≤ target when there is one); ∞ without a guarantee."""
        if self._epsilon is None:
            self._epsilon = compute_epsilon(self.planned_events(), self.delta, self.accountant)
        return self._epsilon

    def max_training_steps(self, mechanisms: Sequence[MechanismGroup] = ()) -> int | None:
        """How many more training steps the target allows after the ledger's `mechanisms`; None without a target
        or without a finite guarantee (no budget to stop at).

        Releases of non-training stages the ledger does not hold yet are reserved first (they are planned, so they
        will be spent). Then the training schedule is followed from where the ledger stands: each stage for its
        remaining planned steps, the last one for as long as the budget allows. With one training mechanism (σ, q)
        and nothing reserved, this is `max_steps_within(target, δ, σ, q, prior=mechanisms)`.
        """
        if self.target_epsilon is None or not self.has_guarantee:
            return None
        mechanisms = list(mechanisms)
        recorded: dict[str, int] = {}
        for group in mechanisms:
            recorded[group.name] = recorded.get(group.name, 0) + group.steps
        prior = list(mechanisms)
        for planned in self.planned:
            if not planned.training and planned.steps > recorded.get(planned.name, 0):
                prior.append(planned.event(planned.steps - recorded.get(planned.name, 0)))
        position = self.training_steps(mechanisms)
        allowed = 0
        stages = self.training_stages
        for index, planned in enumerate(stages):
            last = index == len(stages) - 1
            start, end = planned.training_span()
            remaining = _UNBOUNDED_STEPS if last else max(0, end - max(position, start))
            if remaining == 0:
                continue
            if planned.noise_multiplier is None:  # a calibrated stage planned with no steps: it never runs
                return allowed
            k = max_steps_within(
                self.target_epsilon,
                self.delta,
                planned.noise_multiplier,
                planned.sample_rate,
                accountant=self.accountant,
                prior=prior,
                name=planned.name,
                upper=remaining,
                examples_per_user=planned.stage.examples_per_user,
                bands=planned.stage.bands,
                banded_inverse=planned.stage.banded_inverse,
            )
            allowed += k
            if k < remaining or last:
                return allowed
            prior.append(planned.event(k))
        return allowed  # not reached: the last stage returns

    # ------------------------------------------------------------------ logs and the card
    def to_dict(self) -> dict[str, Any]:
        guarantee, reason = self.guarantee
        d: dict[str, Any] = {
            "dataset_size": self.dataset_size,
            "expected_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "planned_steps": self.planned_steps,
            "delta": self.delta,
            "accountant": self.accountant,
            "target_epsilon": self.target_epsilon,
            "noise_multiplier": self.noise_multiplier,
            "guarantee": guarantee,
            "stages": [p.to_dict() for p in self.planned],
        }
        if reason is not None:
            d["guarantee_note"] = reason
        return d

    def describe(self) -> str:
        """A few lines for the logs: the run, then one line per stage."""
        target = "" if self.target_epsilon is None else f", target ε={self.target_epsilon:g}"
        lines = [
            f"Privacy plan: N={self.dataset_size}, q={self.sample_rate:.5g} (expected batch "
            f"{self.expected_batch_size}), {self.planned_steps} training steps, δ={self.delta:.3g}, "
            f"{self.accountant} accountant{target}."
        ]
        for p in self.planned:
            if p.training and p.steps:
                start, end = p.training_span()
                when = f"steps {start}-{end - 1}"
            else:
                when = "training steps" if p.training else "outside training steps"
            sigma = "σ undefined" if p.noise_multiplier is None else f"σ={p.noise_multiplier:.4g}"
            how = p.stage.calibration
            if how == "share":
                how = f"ε share {p.stage.epsilon_share:g}"
            elif how == "ratio":
                how = f"joint scale, ratio {p.stage.noise_ratio or 1.0:g}"
            elif how == "none":
                how = "no guarantee"
            note = f"; sensitivity: {p.stage.sensitivity}" if p.stage.sensitivity else ""
            if p.stage.examples_per_user is not None:
                note += f"; user level (ELS): at most {p.stage.examples_per_user} examples per user"
            if p.stage.bands is not None:
                kind = "banded-inverse MF, not amplified" if p.stage.banded_inverse else "BandMF"
                note += f"; {kind}: {p.stage.bands} bands, q̂ per partition"
            lines.append(f"  {p.name}: q={p.sample_rate:.5g}, {p.steps} releases ({when}), {sigma} ({how}){note}")
        if not self.has_guarantee:
            lines.append(f"  guarantee: none. {self.guarantee[1]}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        stages = ", ".join(
            f"{p.name}(q={p.sample_rate:.4g}, steps={p.steps}, σ={p.noise_multiplier})" for p in self.planned
        )
        return f"PrivacyPlan(N={self.dataset_size}, δ={self.delta:.3g}, {self.accountant}, [{stages}])"
