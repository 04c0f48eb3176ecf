"""What an audit found, and what it adds to a privacy report: the result, its card entry, its composition into ε.

The audit run is itself a DP release of the data it trained on. This module holds the one place that says how: an
`AuditResult` carries the audit run's mechanisms, and `compose_audits` adds them (renamed "audit:…") to a report's ε
each time a report is made. The trainer and the card import it; nothing here trains.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..privacy import MechanismGroup
from ..privacy.accountants import epsilon_bound, sampler_tail_delta
from ..privacy.events import AUDIT_MECHANISM_PREFIX

# Which data the audit trained on. Only the caller knows; "private" (the default) composes the audit run into the
# released model's guarantee, the other two are the caller's declaration that no training example was used.
AUDIT_DATA = {
    "private": "audit run on the training data, composed into the guarantee's ε",
    "public": "audit run on data declared public by the caller, not composed into ε",
    "disjoint": "audit run on data declared disjoint from the training data by the caller, not composed into ε",
}


@dataclass(frozen=True)
class ScoreBound:
    """The bounds one scoring rule gives; with two rules each is held at half the miss probability. The (ε, δ) test
    and the μ-GDP test read the same guesses; `gdp_epsilon_lower_bound` is μ read as ε at the audit's δ."""

    score: str
    description: str
    guesses: int
    correct: int
    confidence: float
    epsilon_lower_bound: float
    mu_lower_bound: float = 0.0
    gdp_epsilon_lower_bound: float = 0.0
    included: int | None = None  # of its canary set (white-box-gradient has a set of its own)


@dataclass(frozen=True)
class AuditCeiling:
    """The largest bounds the tests could certify with this many canaries and guesses: every guess right."""

    epsilon: float
    mu: float
    gdp_epsilon: float


@dataclass(frozen=True)
class AuditResult:
    """ε_lb is the largest of the per-score bounds; each was computed at a confidence that makes the max valid.

    The audit run is itself a DP release of the data it trained on: `mechanisms` (its ledger, at its `delta` and
    `accountant`) are what `PrivateTrainer.attach_audit` composes into the released model's ε when `audit_data`
    is "private". `guarantee` is the audit run's own ("none" in insecure test mode). `claimed_epsilon` is the figure
    the audit tests: the run's ε, or, without a formal guarantee, the figure named `claim` from the report's
    `not_a_guarantee` (DP-FP paper mode: the paper's CLT approximation), never written as an ε.

    `canaries` counts each set: a run whose white-box score needs gradient canaries (the input embedding does not
    train) has a second set of `canaries` beside the token canaries (`canary_sets`), so `included`, summed over the
    sets, can exceed `canaries` (about half of `canaries` × the number of sets: each is included with probability ½).
    """

    epsilon_lower_bound: float
    confidence: float
    claimed_epsilon: float
    delta: float
    method: str
    canaries: int
    included: int
    k_plus: int
    k_minus: int
    bounds: tuple[ScoreBound, ...]
    date: str
    audit_data: str
    mechanisms: tuple[MechanismGroup, ...]
    accountant: str
    guarantee: str
    dataset_fingerprint: str | None
    claim: str = "epsilon"
    ceiling: AuditCeiling | None = None
    canary_sets: tuple[str, ...] = ("token",)

    @property
    def mu_lower_bound(self) -> float:
        return max((b.mu_lower_bound for b in self.bounds), default=0.0)

    @property
    def gdp_epsilon_lower_bound(self) -> float:
        return max((b.gdp_epsilon_lower_bound for b in self.bounds), default=0.0)

    @property
    def refutes_claim(self) -> bool:
        """True when the audit proves the claimed ε wrong (at the stated confidence)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def declaration(self) -> str:
        return AUDIT_DATA[self.audit_data]

    def canary_summary(self) -> str:
        """What `canaries` and `included` count, in words."""
        sets, total = len(self.canary_sets), self.canaries * len(self.canary_sets)
        layout = (
            f"{sets} sets of {self.canaries:,} ({' and '.join(self.canary_sets)} canaries)"
            if sets > 1
            else f"{self.canaries:,} {self.canary_sets[0]} canaries"
        )
        return (
            f"Canaries: {layout}, each included in the training set independently with probability 1/2: "
            f"{self.included:,} of {total:,} included."
        )

    def verdict(self) -> str:
        """One line saying what the audit showed: a refutation, or none, read against what it could have refuted."""
        tested = "the claimed ε" if self.claim == "epsilon" else f"the tested figure {self.claim} (not a guarantee)"
        found = (
            f"ε_lb = {self.epsilon_lower_bound:.3g} at {self.confidence:.0%} confidence against {tested} = "
            f"{self.claimed_epsilon:.4g}"
        )
        if self.refutes_claim:
            return (
                f"Verdict: REFUTED. {found}: more canaries were guessed right than a run with that privacy "
                f"allows, except with probability {1 - self.confidence:.0%}; the training or its accounting is "
                "broken."
            )
        reach = (
            ""
            if self.ceiling is None
            else (
                f" The largest ε this audit could have refuted is {self.ceiling.epsilon:.3g} (every guess right with "
                f"{self.canaries:,} canaries and {self.k_plus + self.k_minus:,} guesses)"
                + (
                    f", below {self.claimed_epsilon:.4g}: no outcome of it could have refuted the claim."
                    if self.ceiling.epsilon < self.claimed_epsilon
                    else "."
                )
            )
        )
        zero = (
            " A bound of 0 means the guesses were no better than chance explains."
            if self.epsilon_lower_bound <= 0
            else ""
        )
        return (
            f"Verdict: no refutation. {found}: the audit found no evidence against it; a lower bound, not a "
            f"measure of privacy.{zero}{reach}"
        )

    def composed_mechanisms(self) -> list[MechanismGroup]:
        """What the audit adds to the training data's ledger: its run, renamed "audit:…"; nothing for declared data."""
        if self.audit_data != "private":
            return []
        return [replace(g, name=AUDIT_MECHANISM_PREFIX + g.name) for g in self.mechanisms]

    def to_dict(self) -> dict[str, Any]:
        d = {
            **asdict(self),
            "bounds": [asdict(b) for b in self.bounds],
            "refutes_claim": self.refutes_claim,
            "declaration": self.declaration,
            "mu_lower_bound": self.mu_lower_bound,
            "gdp_epsilon_lower_bound": self.gdp_epsilon_lower_bound,
        }
        del d["claimed_epsilon"], d["claim"]
        return {**d, **self._claim_entry(4)}

    def _claim_entry(self, digits: int) -> dict[str, Any]:
        """`claimed_epsilon` for a run with a guarantee; otherwise the figure tested, labelled as not being one."""
        value = round(self.claimed_epsilon, digits)
        if self.guarantee == "formal":
            return {"claimed_epsilon": value}
        return {
            "tested_figure": {
                "name": self.claim,
                "value": value,
                "note": "The audited run has no formal guarantee; this figure is tested as if it "
                "were one, and it is not a bound.",
            }
        }

    def card_entry(self) -> dict[str, Any]:
        """The `privacy.audit` block of a model card; `PrivateTrainer.attach_audit` puts it there."""
        return {
            "kind": "empirical lower bound (not the guarantee)",
            "audit_data": self.audit_data,
            "declaration": self.declaration,
            "epsilon_lower_bound": round(self.epsilon_lower_bound, 4),
            "confidence": self.confidence,
            "canaries": self.canaries,
            "date": self.date,
            **self._claim_entry(4),
            "delta": self.delta,
            "method": self.method,
            "guesses": {"k_plus": self.k_plus, "k_minus": self.k_minus},
            "scores": {
                b.score: {
                    "correct": b.correct,
                    "guesses": b.guesses,
                    "included": b.included,
                    "epsilon_lower_bound": round(b.epsilon_lower_bound, 4),
                    "gaussian_dp": {
                        "mu_lower_bound": round(b.mu_lower_bound, 4),
                        "epsilon_lower_bound_at_delta": round(b.gdp_epsilon_lower_bound, 4),
                    },
                }
                for b in self.bounds
            },
            "gaussian_dp": {
                "mu_lower_bound": round(self.mu_lower_bound, 4),
                "epsilon_lower_bound_at_delta": round(self.gdp_epsilon_lower_bound, 4),
                "note": "refutes μ-GDP for every smaller μ; DP-SGD's trade-off is close to, not exactly, Gaussian, so "
                "this reads the run against a Gaussian curve, not against its accountant's (ε, δ)",
            },
            **(
                {
                    "ceiling": {
                        "epsilon": round(self.ceiling.epsilon, 4),
                        "gaussian_dp_mu": round(self.ceiling.mu, 4),
                        "gaussian_dp_epsilon_at_delta": round(self.ceiling.gdp_epsilon, 4),
                        "note": "the most these tests could certify with these canaries and guesses, every guess right",
                    }
                }
                if self.ceiling is not None
                else {}
            ),
            "procedure": "one training run, Steinke, Nasr, Jagielski (NeurIPS 2023); μ-GDP on the same guesses through "
            "the Gaussian privacy profile",
        }


@functools.lru_cache(maxsize=16)
def _composed_bound(groups: tuple[tuple, ...], delta: float, accountant: str) -> tuple[float, str]:
    """Cached like the ledger's own ε: every card and report would otherwise recompute PRV (seconds each).

    `groups` are the events' `to_dict` items (hashable), rebuilt with `from_dict`: by name, since an ELS event's
    fields are not its serialised values in order."""
    return epsilon_bound([MechanismGroup.from_dict(dict(group)) for group in groups], delta, accountant)


def compose_audits(report: dict[str, Any], audits: Sequence[AuditResult], accountant: str) -> dict[str, Any]:
    """A privacy report whose ε also counts every audit run on the training data, at the report's one δ.

    Composed each time a report is made, never written into the training ledger: checkpoints must not record the
    audit as training spent, and repeated saves or a resume must not count it twice.
    """
    added = [group for audit in audits for group in audit.composed_mechanisms()]
    if not added or "epsilon" not in report:  # no guarantee to compose with (DP-FP paper mode): ε stays absent
        return report
    groups = [MechanismGroup.from_dict(m) for m in report["mechanisms"]] + added
    epsilon, used = _composed_bound(tuple(tuple(g.to_dict().items()) for g in groups), report["delta"], accountant)
    composed = {
        **report,
        "epsilon": epsilon,
        "accountant": used,
        "training_epsilon": report["epsilon"],
        "sampler_tail_delta": sampler_tail_delta(groups, report["delta"]),
        "mechanisms": [g.to_dict() for g in groups],
    }
    if report.get("guarantee") == "formal" and any(a.guarantee != "formal" for a in audits if a.composed_mechanisms()):
        composed.update(
            guarantee="none",
            guarantee_note=(
                "An audit run on the training data, composed into this ε, trained in insecure test mode (its "
                "DPConfig.noise_seed was set): its noise can be replayed by anyone who knows the seed."
            ),
        )
    return composed


def claimed_figure(report: dict[str, Any]) -> tuple[str, float]:
    """What the audit tests: ε, or without a guarantee the first figure of `not_a_guarantee` (the method's own claim,
    e.g. DP-FP's CLT approximation; in insecure test mode the accounting figure)."""
    if "epsilon" in report:
        return "epsilon", float(report["epsilon"])
    figures = report.get("not_a_guarantee") or {}
    if not figures:
        raise ValueError(f"The audited run has no guarantee and no figure to test: {report.get('guarantee_note')}")
    name, figure = next(iter(figures.items()))
    return name, float(figure["value"])
