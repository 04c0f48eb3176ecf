"""The part of δ the noise sampler's finite tail takes (`rng.tail_mass`): every accountant's ε is taken at δ minus it.

The noise is not exactly Gaussian: the sampler never draws beyond `rng.Z_MAX` std. `epsilon_bound` takes what that
costs out of δ first, so its ε at δ is the accountant's at δ − δ_tail, for the releases as this library draws them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from ..events import MechanismGroup, merged_releases
from ..rng import DISC_MISS, MAX_RELEASE_COORDINATES, tail_mass


@functools.lru_cache(maxsize=256)
def _els_tail_mass(sigma: float, q: float, k: int) -> float:
    """Per ELS release (k ≥ 2), the sampler-tail mass: Σ_{j=1..k} Binom(k, q)[j] · tail_mass(σ/j).

    Given that j of the user's examples were sampled, the neighbour's mean moves by at most j·C, i.e. by j/σ std:
    `rng.tail_mass(σ/j)`'s case; j = 0 moves nothing, and J is drawn independently of the noise, so the mass
    outside the discs averages over J. Here the sampling *is* claimed (for the Poisson-subsampled Gaussian it is
    not, see `sampler_tail_delta`): charging the worst shift k/σ every release would make ELS vacuous (at σ = 1,
    k = 16 a 16-std shift lies beyond Z_MAX ≈ 9.4 std).
    """
    probs = stats.binom.pmf(np.arange(1, k + 1), k, q)
    return min(1.0, math.fsum(float(p) * tail_mass(sigma / j) for j, p in enumerate(probs, start=1) if p > 0))


def _tail_mass_per_release(sigma: float, q: float, k: int) -> float:
    return tail_mass(sigma) if k == 1 else _els_tail_mass(sigma, q, k)


def sampler_tail_delta(mechanisms: Sequence[MechanismGroup], delta: float) -> float:
    """The part of `delta` the noise sampler's finite tail takes (see `rng.tail_mass`); ε is the accountant's at
    `delta` minus this.

    Two terms over the k noised releases: Σ steps · tail_mass(σ) (union bound; Poisson sampling would lower it by
    q, which is not claimed; an ELS release counts `_els_tail_mass` instead), then the disc restriction, which
    multiplies the accountant's δ by at most Z^(−k), Z = (1 − 2⁻⁶⁴)^MAX_RELEASE_COORDINATES: the accountant gets
    (δ − Σ)·Z^k. At least `delta` when Σ alone reaches it: no finite ε then.
    """
    noised = [(sigma, q, k, steps) for sigma, q, k, steps in merged_releases(mechanisms, draws=True) if sigma > 0]
    tail = math.fsum(steps * _tail_mass_per_release(sigma, q, k) for sigma, q, k, steps in noised)
    if tail >= delta:
        return tail
    pairs = sum(steps for *_, steps in noised) * MAX_RELEASE_COORDINATES
    return tail + (delta - tail) * -math.expm1(pairs * math.log1p(-DISC_MISS))
