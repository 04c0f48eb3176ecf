"""ε of a heterogeneous history of Poisson-subsampled Gaussian mechanisms, through opacus' accountants.

Why PRV is the default: the PRV accountant (Gopi et al. 2021) composes the privacy-loss distributions
numerically and returns a rigorous *upper* bound on ε (opacus' `PRVAccountant.get_epsilon` returns
`eps_upper`: the ε at δ − δ/1000 plus the discretisation error 0.01, never the point estimate). At
typical DP-SGD settings its ε is 10-20% below RDP's, which loses slack in the RDP → (ε, δ)
conversion; for the same target that is 5-10% less noise. RDP is the cheap, well-known alternative.
The Gaussian-DP central-limit approximation (opacus' "gdp") is not an upper bound and is never used
for the guarantee.

The noise is not exactly Gaussian: the sampler never draws beyond `rng.Z_MAX` std. `compute_epsilon` and
`epsilon_bound` take what that costs (`sampler_tail_delta`) out of δ first, so their ε at δ is the accountant's
at δ − δ_tail, for the releases as this library draws them.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import Domain, PoissonSubsampledGaussianPRV

from ..logs import get_logger
from .rng import DISC_MISS, MAX_RELEASE_COORDINATES, tail_mass

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


# The RDP orders opacus' RDPAccountant (and its PRV domain rule) uses; the reference tables use them too.
_RDP_ORDERS: tuple[float, ...] = tuple(RDPAccountant.DEFAULT_ALPHAS)


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(sigma: float, q: float) -> np.ndarray:
    """RDP at every order of one step of the Poisson-subsampled Gaussian mechanism (σ, q), read-only.

    It depends on (σ, q) only, and k steps compose to k times it, so it is computed once per mechanism:
    it takes ~0.05 s (the fractional orders integrate numerically) and every ε evaluation needs it, PRV's
    domain rule twice. The values are opacus' own (`_compute_rdp`, the function its `compute_rdp` maps).
    """
    with _quiet():
        curve = np.array([rdp_analysis._compute_rdp(q, sigma, order) for order in _RDP_ORDERS])
    curve.flags.writeable = False
    return curve


def _rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """RDP's ε at `delta`: the same arithmetic as opacus' RDPAccountant.get_epsilon, on the cached curves."""
    rdp = sum([_rdp_per_step(sigma, q) * steps for sigma, q, steps in history])
    with _quiet():
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(_RDP_ORDERS), rdp=rdp, delta=delta)
    return float(epsilon)


def _safe_domain_half_width(history: Sequence[tuple[float, float, int]], eps_error: float,
                            delta_error: float) -> float:
    """Half-width L of the privacy-loss interval PRV discretises on (Gopi et al. 2021, remark 5.6).

    The truncated mass must stay below the δ error: L covers the RDP ε of the whole composition at
    δ_err/4 and of every single step at δ_err/(8·steps), plus a margin of 3 (the rule of the authors' code,
    which opacus' `compute_safe_domain_size` also follows; we compute it here from the cached RDP curves,
    so the grid and therefore ε are those opacus' PRVAccountant gives, at a fraction of the cost).
    """
    total = sum(steps for _, _, steps in history)
    half_width = _rdp_epsilon(history, delta_error / 4)
    for sigma, q, _ in history:
        half_width = max(half_width, _rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total)))
    return max(half_width, eps_error) + 3


def _prv_mesh(total_steps: int, eps_error: float, delta_error: float) -> float:
    """PRV's grid spacing (opacus' rule, with its numpy arithmetic so the grid is bit-identical)."""
    return eps_error / np.sqrt(total_steps * np.log(12 / delta_error) / 2)


class _CachedPRVAccountant(PRVAccountant):
    """opacus' PRVAccountant, its discretisation domain computed from the cached per-step RDP curves."""

    def _get_domain(self, prvs: list[PoissonSubsampledGaussianPRV], num_self_compositions: list[int],
                    eps_error: float, delta_error: float) -> Domain:
        history = [(prv.noise_multiplier, prv.sample_rate, k) for prv, k in zip(prvs, num_self_compositions)]
        half_width = _safe_domain_half_width(history, eps_error, delta_error)
        return Domain.create_aligned(-half_width, half_width,
                                     _prv_mesh(sum(num_self_compositions), eps_error, delta_error))


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
            "which is also a rigorous upper bound.", grid,
        )
        return _rdp_epsilon(history, delta), "rdp"
    accountant = _CachedPRVAccountant()
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


def sampler_tail_delta(mechanisms: Sequence[MechanismGroup], delta: float) -> float:
    """The part of `delta` the noise sampler's finite tail takes (see `rng.tail_mass`); ε is the accountant's at
    `delta` minus this.

    Two terms over the k noised releases: Σ steps · tail_mass(σ) (union bound; Poisson sampling would lower it by
    q, which is not claimed), then the disc restriction, which multiplies the accountant's δ by at most Z^(−k),
    Z = (1 − 2⁻⁶⁴)^MAX_RELEASE_COORDINATES: the accountant gets (δ − Σ)·Z^k. At least `delta` when Σ alone
    reaches it: no finite ε then.
    """
    noised = [(sigma, steps) for sigma, _, steps in _history(mechanisms) if sigma > 0]
    tail = math.fsum(steps * tail_mass(sigma) for sigma, steps in noised)
    if tail >= delta:
        return tail
    pairs = sum(steps for _, steps in noised) * MAX_RELEASE_COORDINATES
    return tail + (delta - tail) * -math.expm1(pairs * math.log1p(-DISC_MISS))


def compute_epsilon(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> float:
    """ε at `delta` of the composition of every group (σ, q, steps), an upper bound from `accountant` at δ minus
    `sampler_tail_delta`.

    Empty history → 0.0; any group with σ = 0 and steps > 0 releases a clipped sum unnoised → inf; so does a
    history whose sampler tail alone spends `delta`.
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
    accountant_delta = delta - sampler_tail_delta(mechanisms, delta)
    if accountant_delta <= 0:
        return math.inf, accountant
    if accountant == "rdp":
        return _rdp_epsilon(history, accountant_delta), "rdp"
    return _prv_epsilon(history, accountant_delta)
