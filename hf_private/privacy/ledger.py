"""The privacy ledger: every data-dependent mechanism a run has released, and the ε they add up to.

Its events are typed (`events.MechanismGroup`: Poisson-subsampled Gaussian, no-guarantee and user-level ELS
releases); `accountants` turns them into ε.

The ledger keeps events in order, merging consecutive identical ones into one group, survives checkpoints
as JSON (format 2; format-1 files, which had Poisson-Gaussian groups only, still load; ELS events added the
optional field `examples_per_user`, so format 2 stays: an older hf_private refuses the unknown event type rather
than misreading it), and answers "what is ε now", "what would ε be if" and "is there a formal guarantee at all".
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..logs import get_logger
from .accountants import check_accountant, compute_epsilon, epsilon_bound, sampler_tail_delta
from .events import MechanismGroup, gaussian_event

logger = get_logger(__name__)

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # 1: before typed events, every group a Poisson-subsampled Gaussian


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
        # Adaptive clipping's state (`adaptive_clip.AdaptiveClip.state_dict`: the current C and its range, released
        # values), so a resumed run continues from the adapted C; never read by the accounting.
        self.clip_norm: dict[str, Any] = {}
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
        name: str,
        noise_multiplier: float,
        sample_rate: float,
        max_grad_norm: float | None,
        steps: int,
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
            raise ValueError(
                f"Recorded {event.steps} release(s) of {event.name!r}, but {reason} Release nothing "
                "more under this δ; a plan (PrivacyPlan) refuses such a σ before training."
            )

    def _tail_spends_delta(self) -> str | None:
        """Why ε is infinite because of the sampler's finite tail (`rng.tail_mass`), or None when it is not."""
        tail = sampler_tail_delta(self.mechanisms, self.delta)
        if tail < self.delta:
            return None
        return (
            f"the noise sampler's finite tail alone spends δ_tail={tail:.3g} ≥ δ={self.delta:.3g} (the noise "
            "multiplier is too small for this many releases), so there is no finite ε at this δ."
        )

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
        if self.clip_norm:
            state["clip_norm"] = dict(self.clip_norm)
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
        self.clip_norm = dict(d.get("clip_norm", {}))
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
