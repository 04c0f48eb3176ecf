"""The privacy ledger: every data-dependent mechanism a run has released, and the ε they add up to.

Events are typed (in the spirit of Google dp_accounting's `DpEvent`s), by `MechanismGroup.mechanism`:

* `"poisson_gaussian"` (`POISSON_GAUSSIAN`): a Poisson-subsampled Gaussian mechanism (σ, q), e.g. a DP-SGD
  step, a DP-FROST selection round, a stage of a two-stage method. What opacus' accountants compose.
* `"no_guarantee"` (`NO_GUARANTEE`): a release with no finite guarantee, with the reason (e.g. DP-FP in paper
  mode trains the encoder below its noise on raw data). Serialised with the accounting stand-in σ = 0, q = 1 (an
  un-noised release of the whole dataset), so that any accountant given the card's numbers, ours or opacus' or
  one that ignores the event type, returns ε = ∞ rather than a finite number the release does not have.
* `"els_poisson_gaussian"` (`ELS_POISSON_GAUSSIAN`): user-level DP by example-level sampling (ELS, Charles et al.
  2024, arXiv 2407.07737). Every user keeps at most k = `examples_per_user` examples; *examples* are
  Poisson-sampled at rate q, clipped to C, and N(0, σ²C²) is added to the sum. Adding or removing one user moves
  the sum by at most J·C, J ~ Binomial(k, q): per release a mixture of Gaussians, N(0, σ²) against
  Σ_j Binom(k, q)[j]·N(j, σ²) in units of C (a user with fewer than k examples is the case where some contribute
  0; the vector case reduces to this scalar one, Choquette-Choo et al. 2023, Cor. 4.7), which `accountants`
  composes with dp_accounting's PLD accountant. σ and q are the mechanism's own (the noise multiplier and the
  per-example rate), so an accountant that ignores the event type and k would *understate* ε: read these events
  with `MechanismGroup.from_dict`.

The ledger keeps events in order, merging consecutive identical ones into one group, survives checkpoints
as JSON (format 2; format-1 files, which had Poisson-Gaussian groups only, still load; ELS events added the
optional field `examples_per_user`, so format 2 stays: an older hf_private refuses the unknown event type rather
than misreading it), and answers "what is ε now", "what would ε be if" and "is there a formal guarantee at all".
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..logs import get_logger
from .accountants import check_accountant, compute_epsilon, epsilon_bound, sampler_tail_delta

logger = get_logger(__name__)

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # 1: before typed events, every group a Poisson-subsampled Gaussian

POISSON_GAUSSIAN = "poisson_gaussian"
NO_GUARANTEE = "no_guarantee"
ELS_POISSON_GAUSSIAN = "els_poisson_gaussian"
EVENT_KINDS = (POISSON_GAUSSIAN, NO_GUARANTEE, ELS_POISSON_GAUSSIAN)
# The event types whose release is noised by σ (a Gaussian mechanism): finite ε when σ > 0.
GAUSSIAN_KINDS = (POISSON_GAUSSIAN, ELS_POISSON_GAUSSIAN)


@dataclass
class MechanismGroup:
    """`steps` consecutive releases of one mechanism: a typed ledger event.

    `mechanism` is the event type. For `"poisson_gaussian"` (the default) the release is a Poisson-subsampled
    Gaussian mechanism with noise multiplier σ and rate q; `max_grad_norm` (C) does not enter ε (noise is σ·C
    for sensitivity C) and is kept so the record says what was released. For `"no_guarantee"` the release has
    no finite guarantee, for the stated `reason`; σ and q hold the stand-in 0 and 1 (nothing is noised, everyone
    is in), so any accountant composes it to ε = ∞. Build those with `MechanismGroup.no_guarantee`. For
    `"els_poisson_gaussian"` the release is user-level example-level sampling: q is the per-*example* Poisson rate,
    σ the noise multiplier (noise σ·C), and `examples_per_user` (k ≥ 1) the cap on each user's examples; build
    those with `MechanismGroup.els`. `examples_per_user` is None for every other type.

    The fields' order is the serialised order (`to_dict`); `MechanismGroup.from_dict(group.to_dict())` rebuilds
    any group (positionally, `MechanismGroup(*group.to_dict().values())` rebuilds the Poisson-Gaussian and
    no-guarantee ones only: an ELS event has no `reason` entry before its `examples_per_user`).
    """

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    max_grad_norm: float | None = None
    mechanism: str = POISSON_GAUSSIAN
    reason: str | None = None
    examples_per_user: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("A mechanism needs a name (e.g. 'dp-sgd').")
        if self.mechanism not in EVENT_KINDS:
            raise ValueError(f"Unknown mechanism type {self.mechanism!r}: one of {', '.join(EVENT_KINDS)}.")
        if self.mechanism == NO_GUARANTEE:
            if not (isinstance(self.reason, str) and self.reason.strip()):
                raise ValueError(f"A no-guarantee event ({self.name!r}) must say why there is no guarantee.")
            if (self.noise_multiplier, self.sample_rate) != (0.0, 1.0):
                raise ValueError(
                    f"A no-guarantee event ({self.name!r}) is accounted as un-noised (noise_multiplier=0) on the "
                    f"whole dataset (sample_rate=1), got noise_multiplier={self.noise_multiplier}, sample_rate="
                    f"{self.sample_rate}: use MechanismGroup.no_guarantee(name, reason, steps)."
                )
        elif self.reason is not None:
            raise ValueError(f"Only a no-guarantee event carries a reason ({self.name!r} is {self.mechanism}).")
        if self.mechanism == ELS_POISSON_GAUSSIAN:
            k = self.examples_per_user
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
                raise ValueError(f"An ELS event ({self.name!r}) needs examples_per_user, a positive integer (the cap "
                                 f"k on each user's examples), got {k!r}.")
            self.examples_per_user = int(k)
        elif self.examples_per_user is not None:
            raise ValueError(f"Only an ELS event ({ELS_POISSON_GAUSSIAN!r}) carries examples_per_user ({self.name!r} "
                             f"is {self.mechanism}).")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}.")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}.")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {self.steps}.")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be finite and > 0, got {self.max_grad_norm}.")

    @classmethod
    def no_guarantee(cls, name: str, reason: str, steps: int = 1,
                     max_grad_norm: float | None = None) -> MechanismGroup:
        """`steps` releases with no finite guarantee (ε = ∞), for `reason`."""
        return cls(name, 0.0, 1.0, steps, max_grad_norm, NO_GUARANTEE, reason)

    @classmethod
    def els(cls, name: str, noise_multiplier: float, sample_rate: float, examples_per_user: int, steps: int = 1,
            max_grad_norm: float | None = None) -> MechanismGroup:
        """`steps` user-level ELS releases: examples Poisson-sampled at `sample_rate`, at most `examples_per_user`
        per user, noise σ·C (see the module docstring)."""
        return cls(name, noise_multiplier, sample_rate, steps, max_grad_norm, ELS_POISSON_GAUSSIAN,
                   examples_per_user=examples_per_user)

    @property
    def has_guarantee(self) -> bool:
        """False when this release alone makes ε infinite: a no-guarantee event, or a Gaussian one with σ = 0."""
        return self.steps == 0 or (self.mechanism in GAUSSIAN_KINDS and self.noise_multiplier > 0)

    def why_no_guarantee(self) -> str | None:
        if self.has_guarantee:
            return None
        if self.mechanism == NO_GUARANTEE:
            return f"{self.name}: {self.reason}"
        return f"{self.name}: {self.steps} release(s) without noise (noise_multiplier=0)."

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": str(self.name),
            "noise_multiplier": float(self.noise_multiplier),
            "sample_rate": float(self.sample_rate),
            "steps": int(self.steps),
            "max_grad_norm": None if self.max_grad_norm is None else float(self.max_grad_norm),
            "mechanism": str(self.mechanism),
        }
        if self.reason is not None:
            d["reason"] = str(self.reason)
        if self.examples_per_user is not None:
            d["examples_per_user"] = int(self.examples_per_user)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MechanismGroup:
        """From `to_dict`'s output, or a format-1 dict (no `mechanism`: a Poisson-subsampled Gaussian)."""
        max_grad_norm = d.get("max_grad_norm")
        reason = d.get("reason")
        examples_per_user = d.get("examples_per_user")
        return cls(
            name=str(d["name"]),
            noise_multiplier=float(d["noise_multiplier"]),
            sample_rate=float(d["sample_rate"]),
            steps=int(d["steps"]),
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            mechanism=str(d.get("mechanism", POISSON_GAUSSIAN)),
            reason=None if reason is None else str(reason),
            examples_per_user=None if examples_per_user is None else int(examples_per_user),
        )

    def same_mechanism(self, other: MechanismGroup) -> bool:
        """Same release (type, name, σ, q, C, reason, k), so the two groups can be one with summed steps."""
        return self._identity() == other._identity()

    def _identity(self) -> tuple:
        return (self.mechanism, self.name, self.noise_multiplier, self.sample_rate, self.max_grad_norm, self.reason,
                self.examples_per_user)


def gaussian_event(name: str, noise_multiplier: float, sample_rate: float, steps: int,
                   max_grad_norm: float | None = None, examples_per_user: int | None = None) -> MechanismGroup:
    """`steps` releases of a Gaussian mechanism: a Poisson-subsampled Gaussian (σ, q), or with `examples_per_user`
    = k a user-level ELS one (σ, per-example rate q, at most k examples per user)."""
    if examples_per_user is None:
        return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm)
    return MechanismGroup.els(name, noise_multiplier, sample_rate, examples_per_user, steps, max_grad_norm)


def guarantee_of(mechanisms: Sequence[MechanismGroup]) -> tuple[str, str | None]:
    """("formal", None) when every release has a finite guarantee, else ("none", why), naming each culprit once."""
    reasons: list[str] = []
    for group in mechanisms:
        why = group.why_no_guarantee()
        if why is not None and why not in reasons:
            reasons.append(why)
    if not reasons:
        return "formal", None
    return "none", "No finite (ε, δ) guarantee: " + " ".join(reasons)


def _appended(mechanisms: Sequence[MechanismGroup], event: MechanismGroup) -> list[MechanismGroup]:
    """A new list: `mechanisms` followed by `event`, merged into the last group when it is the same."""
    groups = list(mechanisms)
    if groups and groups[-1].same_mechanism(event):
        groups[-1] = replace(groups[-1], steps=groups[-1].steps + event.steps)
    else:
        groups.append(event)
    return groups


class PrivacyLedger:
    """Ordered record of the mechanisms released on one dataset of `dataset_size` examples, at `delta`."""

    def __init__(self, dataset_size: int, delta: float, accountant: str = "prv") -> None:
        self._configure(dataset_size, delta, accountant)
        self.mechanisms: list[MechanismGroup] = []
        # Lines of training this run's line split from (`hf_private.run.forks`): released from the same data, never
        # ours.
        self.forks: list[dict[str, Any]] = []
        # What the guarantee is about (the privacy unit, the trainer, the public base model): descriptive, never read
        # by the accounting.
        self.subject: dict[str, Any] = {}
        self._bound: tuple[float, str] | None = None

    def _configure(self, dataset_size: int, delta: float, accountant: str) -> None:
        if int(dataset_size) != dataset_size or dataset_size < 1:
            raise ValueError(f"dataset_size must be a positive integer, got {dataset_size}.")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1) (usually below 1/dataset_size), got {delta}.")
        check_accountant(accountant)
        self.dataset_size = int(dataset_size)
        self.delta = float(delta)
        self.accountant = accountant

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(dataset_size={self.dataset_size}, delta={self.delta}, "
            f"accountant={self.accountant!r}, groups={len(self.mechanisms)}, steps={self.total_steps})"
        )

    @staticmethod
    def _event(
        name: str, noise_multiplier: float, sample_rate: float, max_grad_norm: float | None, steps: int,
        examples_per_user: int | None = None,
    ) -> MechanismGroup:
        if steps < 1:
            raise ValueError(f"An event has at least one step, got steps={steps}.")
        clip = None if max_grad_norm is None else float(max_grad_norm)
        return gaussian_event(name, float(noise_multiplier), float(sample_rate), int(steps), clip, examples_per_user)

    def record(
        self,
        name: str,
        noise_multiplier: float,
        sample_rate: float,
        max_grad_norm: float | None = None,
        steps: int = 1,
        examples_per_user: int | None = None,
    ) -> None:
        """Record `steps` releases of mechanism `name` with noise σ and Poisson rate q.

        With `examples_per_user` = k, the releases are user-level ELS ones (an `"els_poisson_gaussian"` event: q is
        the per-example rate, each user has at most k examples); without it, Poisson-subsampled Gaussian ones.
        """
        self.record_event(self._event(name, noise_multiplier, sample_rate, max_grad_norm, steps, examples_per_user))

    def record_no_guarantee(self, name: str, reason: str, steps: int = 1, max_grad_norm: float | None = None) -> None:
        """Record `steps` releases of mechanism `name` that have no finite guarantee, and why (ε becomes ∞)."""
        if steps < 1:
            raise ValueError(f"An event has at least one step, got steps={steps}.")
        self.record_event(MechanismGroup.no_guarantee(name, reason, int(steps), max_grad_norm))

    def record_event(self, event: MechanismGroup) -> None:
        """Record a typed event (a `PrivacyPlan.event(...)`, or any `MechanismGroup` with steps >= 1)."""
        if not isinstance(event, MechanismGroup):
            raise TypeError(f"record_event takes a MechanismGroup, got {type(event).__name__}.")
        if event.steps < 1:
            raise ValueError(f"An event has at least one step, got steps={event.steps}.")
        if event.why_no_guarantee() is not None:
            logger.warning("Recorded a release with no finite privacy guarantee: %s", event.why_no_guarantee())
        self.mechanisms = _appended(self.mechanisms, event)
        self._bound = None
        reason = self._tail_spends_delta()
        if reason is not None:  # recorded first: the release happened, and the ledger must hold it
            raise ValueError(f"Recorded {event.steps} release(s) of {event.name!r}, but {reason} Release nothing "
                             "more under this δ; a plan (PrivacyPlan) refuses such a σ before training.")

    def _tail_spends_delta(self) -> str | None:
        """Why ε is infinite because of the sampler's finite tail (`rng.tail_mass`), or None when it is not."""
        tail = sampler_tail_delta(self.mechanisms, self.delta)
        if tail < self.delta:
            return None
        return (f"the noise sampler's finite tail alone spends δ_tail={tail:.3g} ≥ δ={self.delta:.3g} (the noise "
                "multiplier is too small for this many releases), so there is no finite ε at this δ.")

    def guarantee(self) -> tuple[str, str | None]:
        """("formal", None), or ("none", reason) when a recorded release has no finite guarantee (ε = ∞).

        Only what the ledger knows: a run in insecure test mode (a noise seed) has no guarantee either, which the
        trainer adds.
        """
        guarantee = guarantee_of(self.mechanisms)
        tail = self._tail_spends_delta() if guarantee[0] == "formal" else None
        return guarantee if tail is None else ("none", "No finite (ε, δ) guarantee: " + tail)

    @property
    def total_steps(self) -> int:
        return sum(group.steps for group in self.mechanisms)

    def epsilon(self) -> float:
        """ε of everything recorded, cached until the history changes (PRV takes ~0.02-0.1 s, RDP under 1 ms)."""
        return self._epsilon_bound()[0]

    def _epsilon_bound(self) -> tuple[float, str]:
        if self._bound is None:
            self._bound = epsilon_bound(self.mechanisms, self.delta, self.accountant)
        return self._bound

    def epsilon_if(
        self,
        name: str,
        noise_multiplier: float,
        sample_rate: float,
        max_grad_norm: float | None = None,
        steps: int = 1,
        examples_per_user: int | None = None,
    ) -> float:
        """ε if this event were recorded next (as `record` would record it); the ledger is not changed."""
        event = self._event(name, noise_multiplier, sample_rate, max_grad_norm, steps, examples_per_user)
        return compute_epsilon(_appended(self.mechanisms, event), self.delta, self.accountant)

    def record_fork(self, fork: dict[str, Any]) -> None:
        """Note a line of training this one split from (`hf_private.run.forks.find_fork`); it survives checkpoints."""
        self.forks.append(fork)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "format_version": FORMAT_VERSION,
            "dataset_size": self.dataset_size,
            "delta": self.delta,
            "accountant": self.accountant,
            "mechanisms": [group.to_dict() for group in self.mechanisms],
        }
        if self.forks:
            state["forks"] = self.forks
        if self.subject:
            state["subject"] = dict(self.subject)
        return state

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace this ledger's contents with a saved state (resuming continues the same ledger)."""
        version = d.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"Unsupported privacy ledger format_version {version!r} (this version reads "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}): written by a newer hf_private?"
            )
        if version == 1 and any("mechanism" in group for group in d["mechanisms"]):
            raise ValueError("A format_version 1 ledger has no typed events, but this one has a 'mechanism' field.")
        mechanisms = [MechanismGroup.from_dict(group) for group in d["mechanisms"]]
        self._configure(d["dataset_size"], d["delta"], d["accountant"])
        self.mechanisms = mechanisms
        self.forks = list(d.get("forks", []))
        self.subject = dict(d.get("subject", {}))
        self._bound = None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the ledger as JSON, atomically (a crash mid-write must not lose the spent budget)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrivacyLedger:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        ledger = cls(state["dataset_size"], state["delta"], state["accountant"])
        ledger.load_state_dict(state)
        return ledger

    def report(self) -> dict[str, Any]:
        """ε and what it rests on; `accountant` is the one that produced ε (RDP where PRV could not run).

        `guarantee` is "formal", or "none" with `guarantee_note` saying why (ε is then ∞). Each entry of
        `mechanisms` is a typed event that opacus' accountants recompute ε from: history (σ, q, steps), at δ minus
        `sampler_tail_delta` (the part of δ the noise sampler's finite tail takes, `rng.tail_mass`). A history with
        ELS events (k ≥ 2) is recomputed with dp_accounting's PLD accountant instead (`accountant` then says
        "pld"; see `accountants.epsilon_bound`).
        """
        epsilon, accountant = self._epsilon_bound()
        guarantee, reason = self.guarantee()
        report = {
            "epsilon": epsilon,
            "delta": self.delta,
            "sampler_tail_delta": sampler_tail_delta(self.mechanisms, self.delta),
            "accountant": accountant,
            "dataset_size": self.dataset_size,
            "steps": self.total_steps,
            "mechanisms": [group.to_dict() for group in self.mechanisms],
            "guarantee": guarantee,
        }
        if reason is not None:
            report["guarantee_note"] = reason
        return report
