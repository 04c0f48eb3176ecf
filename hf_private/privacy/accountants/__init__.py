"""ε of a history of typed events (`events.MechanismGroup`), from the registered accountants, one file each.

* "prv" (`prv.py`, the default): opacus' PRV accountant, a rigorous upper bound, 10-20% below RDP at typical
  DP-SGD settings; for a history with a user-level ELS release (k ≥ 2) dp_accounting's PLD accountant (`pld.py`,
  reported as "pld"), since opacus has no mixture-of-Gaussians PRV.
* "rdp" (`rdp.py`): opacus' RDP accountant, cheap and well known; an ELS release is composed as the
  Poisson-subsampled Gaussian that dominates it (`rdp.els_fallback`).

The Gaussian-DP central-limit approximation (opacus' "gdp") is not an upper bound and is never used for the
guarantee. The noise is not exactly Gaussian (the sampler never draws beyond `rng.Z_MAX` std): `epsilon_bound`
takes what that costs (`tail.sampler_tail_delta`) out of δ before it asks the accountant.

Adding an accountant: a file here with an `Accountant` subclass decorated `@register_accountant("name")`, and its
import line below; every choice of accountant (the plan, the ledger, `MethodConfig`, `hf-private-audit`) reads the
registry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..events import MechanismGroup, merged_releases
from . import prv, rdp  # noqa: F401  (importing an accountant's file registers it)
from .base import Accountant
from .registry import accountant_named, check_accountant, register_accountant, registered_accountants
from .tail import sampler_tail_delta

__all__ = [
    "SUPPORTED_ACCOUNTANTS",
    "Accountant",
    "accountant_named",
    "check_accountant",
    "compute_epsilon",
    "epsilon_bound",
    "register_accountant",
    "registered_accountants",
    "sampler_tail_delta",
]

#: The accountants hf_private ships (those registered when it is imported).
SUPPORTED_ACCOUNTANTS = registered_accountants()


def compute_epsilon(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> float:
    """ε at `delta` of the composition of every group (σ, q, steps; k for an ELS event), an upper bound from
    `accountant` at δ minus `sampler_tail_delta`.

    Empty history → 0.0; any group with σ = 0 and steps > 0 releases a clipped sum unnoised → inf; so does a
    history whose sampler tail alone spends `delta`.
    """
    return epsilon_bound(mechanisms, delta, accountant)[0]


def epsilon_bound(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> tuple[float, str]:
    """`compute_epsilon`, plus the accountant that produced the bound: `accountant`, or the one that stood in for it
    ("pld" where "prv" composes a history with an ELS event of k ≥ 2, "rdp" where PRV or PLD cannot run).

    Reports name the latter: where PRV cannot run and RDP stands in, the card must say so, so that
    whoever recomputes ε from the card's mechanisms uses the accountant that gave the number.
    """
    chosen = accountant_named(accountant)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    releases = merged_releases(mechanisms)
    if not releases:
        return 0.0, accountant
    if any(release.noise_multiplier == 0 for release in releases):
        return math.inf, accountant
    accountant_delta = delta - sampler_tail_delta(mechanisms, delta)
    if accountant_delta <= 0:
        return math.inf, accountant
    return chosen.epsilon(releases, accountant_delta)
