"""ε of a heterogeneous history of Poisson-subsampled Gaussian mechanisms, through opacus' accountants.

Why PRV is the default: the PRV accountant (Gopi et al. 2021) composes the privacy-loss distributions
numerically and returns a rigorous *upper* bound on ε (opacus' `PRVAccountant.get_epsilon` returns
`eps_upper`: the ε at δ − δ/1000 plus the discretisation error 0.01, never the point estimate). At
typical DP-SGD settings its ε is 10-20% below RDP's, which loses slack in the RDP → (ε, δ)
conversion; for the same target that is 5-10% less noise. RDP is the cheap, well-known alternative.
The Gaussian-DP central-limit approximation (opacus' "gdp") is not an upper bound and is never used
for the guarantee.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

from ..logs import get_logger

if TYPE_CHECKING:
    from .ledger import MechanismGroup

logger = get_logger(__name__)

SUPPORTED_ACCOUNTANTS = ("prv", "rdp")

# opacus' PRV defaults: the bound includes +eps_error, and is taken at δ - delta_error. (opacus flags
# its domain-size rule as adapted from the authors' code, safe for eps_error < 1; ours is 0.01.)
_PRV_EPS_ERROR = 0.01
_PRV_DELTA_ERROR_FRACTION = 1e-3
# PRV discretises the privacy loss on a grid whose size grows with the RDP ε of the history and with
# √steps; at small σ it explodes (σ=0.1, q=0.01, 1000 steps: ~2e8 points, 13 minutes, gigabytes).
# Past this size (~1.5 GB and ~10 s; a 100k-step run at σ=1, q=0.01 is just below it) the RDP bound,
# also rigorous, is used instead.
_PRV_MAX_GRID = 2**23


def check_accountant(accountant: str) -> None:
    """Raise a ValueError naming the choices when `accountant` is not one we report guarantees with."""
    if accountant not in SUPPORTED_ACCOUNTANTS:
        raise ValueError(
            f"Unknown accountant {accountant!r}: choose one of {', '.join(SUPPORTED_ACCOUNTANTS)}. "
            "(GDP/CLT is an approximation, not an upper bound, so it cannot certify a guarantee.)"
        )


def _history(mechanisms: Sequence[MechanismGroup]) -> list[tuple[float, float, int]]:
    """opacus history tuples (σ, q, steps), one per distinct (σ, q).

    Composition is order-independent for both accountants, so equal mechanisms are merged wherever
    they occur: the result is the same and PRV convolves fewer distributions.
    """
    steps: dict[tuple[float, float], int] = {}
    for group in mechanisms:
        if group.steps > 0:
            key = (float(group.noise_multiplier), float(group.sample_rate))
            steps[key] = steps.get(key, 0) + int(group.steps)
    return [(sigma, q, k) for (sigma, q), k in steps.items()]


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence opacus' numerical chatter that does not affect the bound.

    "Optimal order is the smallest/largest alpha": the RDP bound is still valid, only looser (we keep
    opacus' default orders, which the reference tables use); overflow in PRV's far tails.
    """
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.filterwarnings("ignore", message="Optimal order")
        yield


def _rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    accountant = RDPAccountant()
    accountant.history = history
    with _quiet():
        return float(accountant.get_epsilon(delta=delta))


def _prv_grid_size(history: list[tuple[float, float, int]], delta: float) -> float:
    """Number of points opacus' PRVAccountant would discretise the history on (its own domain rule)."""
    delta_error = delta * _PRV_DELTA_ERROR_FRACTION
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    steps = [k for _, _, k in history]
    with _quiet():
        half_width = compute_safe_domain_size(prvs, steps, _PRV_EPS_ERROR, delta_error)
    mesh = _PRV_EPS_ERROR / math.sqrt(sum(steps) * math.log(12 / delta_error) / 2)
    return 2 * half_width / mesh


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> tuple[float, str]:
    """PRV's ε, or RDP's where PRV cannot run; the second item names the accountant that gave it."""
    grid = _prv_grid_size(history, delta)
    if grid > _PRV_MAX_GRID:
        logger.info(
            "PRV would need a %.3g-point grid for this history (ε is very large); using the RDP bound, "
            "which is also a rigorous upper bound.", grid,
        )
        return _rdp_epsilon(history, delta), "rdp"
    accountant = PRVAccountant()
    accountant.history = history
    try:
        with _quiet():
            epsilon = accountant.get_epsilon(
                delta, eps_error=_PRV_EPS_ERROR, delta_error=delta * _PRV_DELTA_ERROR_FRACTION
            )
        return float(epsilon), "prv"
    except (RuntimeError, ValueError) as err:  # opacus' numerical guards: "Cannot compute epsilon", ...
        logger.warning("PRV accounting failed (%s); using the RDP bound, also a rigorous upper bound.", err)
        return _rdp_epsilon(history, delta), "rdp"


def compute_epsilon(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> float:
    """ε at `delta` of the composition of every group (σ, q, steps), an upper bound from `accountant`.

    Empty history → 0.0; any group with σ = 0 and steps > 0 releases a clipped sum unnoised → inf.
    """
    return epsilon_bound(mechanisms, delta, accountant)[0]


def epsilon_bound(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> tuple[float, str]:
    """`compute_epsilon`, plus the accountant that produced the bound.

    Reports name the latter: where PRV cannot run and RDP stands in, the card must say so, so that
    whoever recomputes ε from the card's mechanisms uses the accountant that gave the number.
    """
    check_accountant(accountant)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    history = _history(mechanisms)
    if not history:
        return 0.0, accountant
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf, accountant
    if accountant == "rdp":
        return _rdp_epsilon(history, delta), "rdp"
    return _prv_epsilon(history, delta)
