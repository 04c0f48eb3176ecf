"""PRV, the default: opacus' privacy-random-variable accountant, the tightest rigorous bound here.

The PRV accountant (Gopi et al. 2021) composes the privacy-loss distributions numerically and returns a rigorous
*upper* bound on ε (opacus' `PRVAccountant.get_epsilon` returns `eps_upper`: the ε at δ − δ/1000 plus the
discretisation error 0.01, never the point estimate). At typical DP-SGD settings its ε is 10-20% below RDP's, which
loses slack in the RDP → (ε, δ) conversion; for the same target that is 5-10% less noise. Where it cannot run (its
grid would explode, or opacus' numerical guards refuse) the RDP bound, also rigorous, stands in and is named.
A history with a user-level ELS release (k ≥ 2) is composed whole by dp_accounting's PLD accountant (`pld`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from opacus.accountants import PRVAccountant
from opacus.accountants.analysis.prv import Domain, PoissonSubsampledGaussianPRV

from ...logs import get_logger
from ..events import Releases
from .base import Accountant, quiet_numerics
from .pld import pld_epsilon
from .rdp import rdp_epsilon
from .registry import register_accountant

logger = get_logger(__name__)

# opacus' PRV defaults: the bound includes +eps_error, and is taken at δ - delta_error. (opacus flags
# its domain-size rule as adapted from the authors' code, safe for eps_error < 1; ours is 0.01.)
_PRV_EPS_ERROR = 0.01
_PRV_DELTA_ERROR_FRACTION = 1e-3
# PRV discretises the privacy loss on a grid whose size grows with the RDP ε of the history and with
# √steps; at small σ it explodes (σ=0.1, q=0.01, 1000 steps: ~2e8 points, 13 minutes, gigabytes).
# Past this size (~1.5 GB and ~10 s; a 100k-step run at σ=1, q=0.01 is just below it) the RDP bound,
# also rigorous, is used instead.
_PRV_MAX_GRID = 2**23


def _safe_domain_half_width(history: Sequence[tuple[float, float, int]], eps_error: float, delta_error: float) -> float:
    """Half-width L of the privacy-loss interval PRV discretises on (Gopi et al. 2021, remark 5.6).

    The truncated mass must stay below the δ error: L covers the RDP ε of the whole composition at
    δ_err/4 and of every single step at δ_err/(8·steps), plus a margin of 3 (the rule of the authors' code,
    which opacus' `compute_safe_domain_size` also follows; we compute it here from the cached RDP curves,
    so the grid and therefore ε are those opacus' PRVAccountant gives, at a fraction of the cost).
    """
    total = sum(steps for _, _, steps in history)
    half_width = rdp_epsilon(history, delta_error / 4)
    for sigma, q, _ in history:
        half_width = max(half_width, rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total)))
    return max(half_width, eps_error) + 3


def _prv_mesh(total_steps: int, eps_error: float, delta_error: float) -> float:
    """PRV's grid spacing (opacus' rule, with its numpy arithmetic so the grid is bit-identical)."""
    return eps_error / np.sqrt(total_steps * np.log(12 / delta_error) / 2)


class _CachedPRVAccountant(PRVAccountant):
    """opacus' PRVAccountant, its discretisation domain computed from the cached per-step RDP curves."""

    def _get_domain(
        self,
        prvs: list[PoissonSubsampledGaussianPRV],
        num_self_compositions: list[int],
        eps_error: float,
        delta_error: float,
    ) -> Domain:
        history = [(prv.noise_multiplier, prv.sample_rate, k) for prv, k in zip(prvs, num_self_compositions)]
        half_width = _safe_domain_half_width(history, eps_error, delta_error)
        return Domain.create_aligned(
            -half_width, half_width, _prv_mesh(sum(num_self_compositions), eps_error, delta_error)
        )


def _prv_grid_size(history: list[tuple[float, float, int]], delta: float) -> float:
    """Number of points opacus' PRVAccountant would discretise the history on (its own domain rule)."""
    delta_error = delta * _PRV_DELTA_ERROR_FRACTION
    half_width = _safe_domain_half_width(history, _PRV_EPS_ERROR, delta_error)
    mesh = _prv_mesh(sum(steps for _, _, steps in history), _PRV_EPS_ERROR, delta_error)
    return float(2 * half_width / mesh)


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> tuple[float, str]:
    """PRV's ε, or RDP's where PRV cannot run; the second item names the accountant that gave it."""
    grid = _prv_grid_size(history, delta)
    if grid > _PRV_MAX_GRID:
        logger.info(
            "PRV would need a %.3g-point grid for this history (ε is very large); using the RDP bound, "
            "which is also a rigorous upper bound.",
            grid,
        )
        return rdp_epsilon(history, delta), "rdp"
    accountant = _CachedPRVAccountant()
    accountant.history = history
    try:
        with quiet_numerics():
            epsilon = accountant.get_epsilon(
                delta, eps_error=_PRV_EPS_ERROR, delta_error=delta * _PRV_DELTA_ERROR_FRACTION
            )
        return float(epsilon), "prv"
    except (RuntimeError, ValueError) as err:  # opacus' numerical guards: "Cannot compute epsilon", ...
        logger.warning("PRV accounting failed (%s); using the RDP bound, also a rigorous upper bound.", err)
        return rdp_epsilon(history, delta), "rdp"


@register_accountant("prv")
class PRV(Accountant):
    """Privacy random variables (opacus), PLD (dp_accounting) for histories with ELS releases; RDP seeds its searches
    (PRV evaluations cost 0.1-0.3 s at a thousand steps, RDP's ~20 ms, and RDP's answer is close)."""

    search_seed = "rdp"

    def epsilon(self, releases: Sequence[Releases], delta: float) -> tuple[float, str]:
        if any(k > 1 for _, _, k, _ in releases):
            return pld_epsilon(releases, delta)
        return _prv_epsilon([(sigma, q, n) for sigma, q, _, n in releases], delta)
