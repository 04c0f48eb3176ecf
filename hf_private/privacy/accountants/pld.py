"""dp_accounting's PLD accountant for histories with user-level ELS releases: the tight bound "prv" gives them.

opacus' PRV accountant has no mixture-of-Gaussians PRV, and its discretised PRVs cannot be composed with
dp_accounting's privacy-loss distributions, so a history holding an ELS release of k ≥ 2 is composed here *whole*:
`MixtureOfGaussiansDpEvent` for the ELS releases, the Poisson-subsampled Gaussian
`PoissonSampledDpEvent(q, GaussianDpEvent(σ))` for the others; pessimistic connect-the-dots discretisation, both
add and remove directions: an upper bound. The report names it "pld". Not registered on its own: it is what "prv"
does for such a history.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from ...logs import get_logger
from ..events import Releases
from .base import quiet_numerics
from .rdp import fallback_history, rdp_epsilon

logger = get_logger(__name__)

# The privacy loss is discretised on a grid of this spacing, or coarser where one release's loss spans more than
# _PLD_MAX_POINTS of it: building a mixture's distribution costs ~50 µs per point (σ = 1, q = 0.01, k = 16: 85k
# points at 1e-3, 4.6 s), composing it is cheap. The rounding is pessimistic, so any spacing gives an upper bound;
# 1e-3 is within 1e-3 of the 1e-4 figure at 1000 steps.
PLD_LABEL = "pld"
_PLD_MIN_INTERVAL = 1e-3
_PLD_MAX_POINTS = 2**15


def els_mixture(sample_rate: float, examples_per_user: int) -> tuple[list[float], list[float]]:
    """The sensitivities 0..k (units of C) and their probabilities Binomial(k, q) of one ELS release."""
    k = int(examples_per_user)
    return [float(j) for j in range(k + 1)], [float(p) for p in stats.binom.pmf(np.arange(k + 1), k, sample_rate)]


def _privacy_losses(sigma: float, q: float, k: int) -> list:
    """dp_accounting's privacy-loss objects of one release (σ, q, k), remove and add directions."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    directions = (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD)
    if k == 1:
        return [plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=a) for a in directions]
    sensitivities, probs = els_mixture(q, k)
    return [plm.MixtureGaussianPrivacyLoss(sigma, sensitivities, probs, adjacency_type=a) for a in directions]


def _pld_interval(releases: Sequence[Releases]) -> float:
    """One grid spacing for the whole history (dp_accounting composes only equal spacings): _PLD_MIN_INTERVAL, or
    the widest release's loss range over _PLD_MAX_POINTS."""
    width = 0.0
    for sigma, q, k, _ in releases:
        for loss in _privacy_losses(sigma, q, k):
            bounds = loss.connect_dots_bounds()
            width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
    return max(_PLD_MIN_INTERVAL, width / _PLD_MAX_POINTS)


@functools.lru_cache(maxsize=32)
def _pld_per_step(sigma: float, q: float, k: int, interval: float):
    """dp_accounting's privacy-loss distribution of one release (σ, q, k) on the grid `interval`, both directions.

    Cached: the ledger asks for ε after every step, with the same releases and one more step.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    if k == 1:
        return pld.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval)
    sensitivities, probs = els_mixture(q, k)
    return pld.from_mixture_gaussian_mechanism(sigma, sensitivities, probs, value_discretization_interval=interval)


def pld_epsilon(releases: Sequence[Releases], delta: float) -> tuple[float, str]:
    """ε of the whole history from dp_accounting's PLD accountant, or the RDP bound of `rdp.fallback_history` where
    it cannot run; the second item names the accountant that gave it.

    What `PLDAccountant(value_discretization_interval=_pld_interval(releases))` gives composing
    `MixtureOfGaussiansDpEvent(σ, [0..k], Binom(k, q))` (ELS) and `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`
    (the others) `steps` times each, built here from the same dp_accounting functions, one release's distribution
    cached and self-composed.
    """
    try:
        with quiet_numerics():
            interval = _pld_interval(releases)
            composed = functools.reduce(  # releases are never empty: "prv" sends the histories with an ELS release
                lambda history, step: history.compose(step),
                (_pld_per_step(sigma, q, k, interval).self_compose(steps) for sigma, q, k, steps in releases),
            )
            epsilon = float(composed.get_epsilon_for_delta(delta))
        if not math.isnan(epsilon):
            return epsilon, PLD_LABEL
        raise ValueError("ε is NaN")
    except (ArithmeticError, RuntimeError, ValueError) as err:
        logger.warning(
            "PLD accounting failed (%s); using the RDP bound of the Poisson-subsampled Gaussian that "
            "dominates each ELS release (els_fallback), also a rigorous upper bound.",
            err,
        )
        return rdp_epsilon(fallback_history(releases), delta), "rdp"
