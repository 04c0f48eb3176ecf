"""RDP: opacus' Rényi-DP accountant for the Poisson-subsampled Gaussian, cheap and well known, looser than PRV.

dp_accounting's RDP accountant has no mixture-of-Gaussians event either (0.6.0 supports Gaussian, Poisson- and
without-replacement-sampled Gaussian, tree aggregation, ...), so a user-level ELS release (k ≥ 2) is composed as
the looser `els_fallback` mechanism, a Poisson-subsampled Gaussian that dominates it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis

from ..events import Releases
from .base import Accountant, quiet_numerics
from .registry import register_accountant

# The RDP orders opacus' RDPAccountant (and its PRV domain rule) uses; the reference tables use them too.
_RDP_ORDERS: tuple[float, ...] = tuple(RDPAccountant.DEFAULT_ALPHAS)


@functools.lru_cache(maxsize=1024)
def rdp_per_step(sigma: float, q: float) -> np.ndarray:
    """RDP at every order of one step of the Poisson-subsampled Gaussian mechanism (σ, q), read-only.

    It depends on (σ, q) only, and k steps compose to k times it, so it is computed once per mechanism:
    it takes ~0.05 s (the fractional orders integrate numerically) and every ε evaluation needs it, PRV's
    domain rule twice. The values are opacus' own (`_compute_rdp`, the function its `compute_rdp` maps).
    """
    with quiet_numerics():
        curve = np.array([rdp_analysis._compute_rdp(q, sigma, order) for order in _RDP_ORDERS])
    curve.flags.writeable = False
    return curve


def rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """RDP's ε at `delta` of opacus history tuples (σ, q, steps): the same arithmetic as opacus' RDPAccountant's
    get_epsilon, on the cached curves."""
    rdp = sum([rdp_per_step(sigma, q) * steps for sigma, q, steps in history])
    with quiet_numerics():
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(_RDP_ORDERS), rdp=rdp, delta=delta)
    return float(epsilon)


def els_fallback(noise_multiplier: float, sample_rate: float, examples_per_user: int) -> tuple[float, float]:
    """(σ', q') of the Poisson-subsampled Gaussian that dominates one ELS release (σ, q, k): σ' = σ/k (sensitivity
    k·C) and q' = 1 − (1 − q)^k (the chance that any of the user's k examples is sampled).

    Why it dominates, in both directions (add and remove a user). With b_j = Binom(k, q)[j] and Q = N(0, σ²), the
    release is P = Σ_j b_j N(j, σ²) = (1 − q')·Q + q'·M, M = Σ_{j≥1} (b_j/q') N(j, σ²), and the fallback is
    P' = (1 − q')·Q + q'·N(k, σ²). (1) The hockey-stick divergence H_γ is jointly convex, so both H_γ(P‖Q) and
    H_γ(Q‖P) are at most the average, with weights b_j/q' over j ≥ 1, of the same divergence with
    P'_j = (1 − q')·Q + q'·N(j, σ²) in place of P (Σ_{j≥1} (b_j/q')·P'_j = P). (2) For 1 ≤ j ≤ k the kernel
    x ↦ (j/k)·x + N(0, σ²(1 − j²/k²)) maps N(0, σ²) to itself and N(k, σ²) to N(j, σ²), hence (Q, P'_k) to
    (Q, P'_j): by data processing each term is at most the j = k one, and P'_k = P'. Loose: k·C is charged
    whenever any example of the user is sampled (here it is looser than group privacy of the example-level
    guarantee, see tests/privacy/test_user_level_accounting.py).
    """
    k = int(examples_per_user)
    any_sampled = 1.0 if sample_rate >= 1 else -math.expm1(k * math.log1p(-sample_rate))
    return noise_multiplier / k, any_sampled


def fallback_history(releases: Sequence[Releases]) -> list[tuple[float, float, int]]:
    """opacus history tuples (σ, q, steps) with every ELS release replaced by `els_fallback`, merged as in
    `events.merged_releases` (releases with k = 1 pass through as they are)."""
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, k, n in releases:
        key = (sigma, q) if k == 1 else els_fallback(sigma, q, k)
        steps[key] = steps.get(key, 0) + n
    return [(sigma, q, n) for (sigma, q), n in steps.items()]


@register_accountant("rdp")
class RDP(Accountant):
    """Rényi DP (opacus' orders and conversion to (ε, δ)): cheap, so it seeds the searches of the tighter ones."""

    budget_hint = "RDP cannot certify ε below a floor at any σ; the tighter 'prv' accountant can go lower."

    def epsilon(self, releases: Sequence[Releases], delta: float) -> tuple[float, str]:
        return rdp_epsilon(fallback_history(releases), delta), "rdp"
