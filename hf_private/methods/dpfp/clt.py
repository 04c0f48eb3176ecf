"""DP-FP's privacy arithmetic as published: Gaussian-DP with central-limit composition (seed 004, §5.2).

Why this module exists: DP-FP's "paper mode" calibrates its representation noise exactly as the paper does, so the
reproduction must redo the paper's accounting. Algorithm 1 turns a target (ε, δ) into a total μ with the μ-GDP
trade-off (Eq. 3), then into a per-release noise multiplier with the central-limit theorem for T·M Poisson-
subsampled Gaussian releases (Eqs. 11/16): μ_tot = q·√(K·(e^{1/σ²} − 1)).

The CLT is an approximation, not an upper bound. It is accurate only when each release's μ = 1/σ is small; at the
paper's settings σ ≈ 0.3, so μ ≈ 3, and the exact ε of the same subsampled Gaussian (PRV/PLD, or RDP) is 1.8-3.4×
the CLT figure (methods_spec §6.1(c)). hf_private therefore reports the value of `clt_epsilon` only as "the
paper's CLT estimate", never as a guarantee; guarantees come from `hf_private.privacy.compute_epsilon`.

σ here is the noise multiplier: the noise std divided by the clip norm C (the paper's σ is C times it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Integral, Real

from scipy.optimize import brentq
from scipy.special import log_ndtr

__all__ = [
    "clt_epsilon",
    "clt_mu",
    "clt_noise_multiplier",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
]

# brentq's tightest tolerances: round trips (σ → ε → σ) must agree to ~1e-12, far inside the paper's 2 decimals.
_XTOL = 1e-15
_RTOL = 4 * 2.220446049250313e-16
# Bracket expansion limits: μ for δ < 1 in double precision stays below ~20, and ε for μ ≤ 1e3 below ~1e6.
_MU_RANGE = (1e-6, 1e6)
_EPS_MAX = 1e12


def _check_real(name: str, value: object, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """`value` as a float, or a ValueError naming the parameter and the allowed interval."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {value!r}.")
    x = float(value)
    too_low = x <= low if low_open else x < low
    too_high = x >= high if high_open else x > high
    if math.isnan(x) or too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}.")
    return x


def _check_epsilon(epsilon: object) -> float:
    """ε as a finite float >= 0."""
    return _check_real("epsilon", epsilon, 0.0, math.inf, low_open=False, high_open=True)


def _check_delta(delta: object) -> float:
    """δ as a float in (0, 1): δ = 0 has no finite GDP solution, δ = 1 says nothing."""
    return _check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True)


def _check_mu(mu: object) -> float:
    """μ as a finite float > 0."""
    return _check_real("mu", mu, 0.0, math.inf, low_open=True, high_open=True)


def _check_noise_multiplier(noise_multiplier: object) -> float:
    """σ as a finite float > 0: σ = 0 is an unnoised release, for which no μ is finite."""
    return _check_real("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True)


def _check_sample_rate(sample_rate: object) -> float:
    """q as a float in (0, 1]."""
    return _check_real("sample_rate", sample_rate, 0.0, 1.0, low_open=True, high_open=False)


def _check_steps(steps: object) -> int:
    """K as an int >= 1 (the number of releases; the CLT composes a count, not a fraction)."""
    if isinstance(steps, bool) or not isinstance(steps, Integral) or steps < 1:
        raise ValueError(f"steps (the number of releases K = T·M) must be an integer >= 1, got {steps!r}.")
    return int(steps)


def _log_gdp_delta(epsilon: float, mu: float) -> float:
    """log δ(ε; μ), computed as log Φ(a) + log(1 − e^{ε + log Φ(b) − log Φ(a)}) so that no term overflows.

    Returns −inf where δ is below double precision (tiny μ): callers only need its sign against a target there.
    """
    log_a = float(log_ndtr(-epsilon / mu + mu / 2))
    log_b = float(log_ndtr(-epsilon / mu - mu / 2))
    exponent = epsilon + log_b - log_a
    if not exponent < 0:  # δ > 0 exactly, but Φ(a) and e^ε Φ(b) agree to every bit here
        return -math.inf
    return log_a + math.log(-math.expm1(exponent))


def _root(f: Callable[[float], float], low: float, high: float) -> float:
    """brentq at its tightest tolerances on a bracket already checked to change sign."""
    return float(brentq(f, low, high, xtol=_XTOL, rtol=_RTOL, maxiter=500))


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε; μ) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2): the δ at which μ-GDP implies (ε, δ)-DP (Eq. 3)."""
    epsilon, mu = _check_epsilon(epsilon), _check_mu(mu)
    return math.exp(_log_gdp_delta(epsilon, mu))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The μ with δ(ε; μ) = δ (Eq. 3; Algorithm 1 line 1): the largest μ-GDP that is still (ε, δ)-DP.

    δ(ε; μ) increases from 0 to 1 in μ, so the root is unique; the bracket is widened geometrically from μ = 1.
    """
    epsilon, delta = _check_epsilon(epsilon), _check_delta(delta)
    log_target = math.log(delta)

    def excess(mu: float) -> float:
        return _log_gdp_delta(epsilon, mu) - log_target

    low = high = 1.0
    while excess(low) >= 0:
        low /= 2
        if low < _MU_RANGE[0]:
            raise ValueError(f"No μ >= {_MU_RANGE[0]} gives delta={delta} at epsilon={epsilon}.")
    while excess(high) <= 0:
        high *= 2
        if high > _MU_RANGE[1]:
            raise ValueError(f"No μ <= {_MU_RANGE[1]} gives delta={delta} at epsilon={epsilon}.")
    return _root(excess, low, high)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε a μ-GDP mechanism gives at δ: the root of δ(ε; μ) = δ in ε, or 0 when δ(0; μ) ≤ δ already.

    δ(ε; μ) decreases in ε, so the root is unique; the bracket is widened geometrically from ε = 1.
    """
    mu, delta = _check_mu(mu), _check_delta(delta)
    log_target = math.log(delta)

    def excess(epsilon: float) -> float:
        return _log_gdp_delta(epsilon, mu) - log_target

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
        if high > _EPS_MAX:
            raise ValueError(f"No epsilon <= {_EPS_MAX} gives delta={delta} at mu={mu}.")
    return _root(excess, 0.0, high)


def clt_mu(noise_multiplier: float, sample_rate: float, steps: int) -> float:
    """μ_tot = q·√(K·(e^{1/σ²} − 1)) (Eqs. 11/16): K Poisson-subsampled Gaussian releases composed by the CLT.

    Each release is (1/σ)-GDP before subsampling; the paper's p·√(T·M·(e^{μ²} − 1)) is this with q = p,
    K = T·M and μ = C/σ_paper = 1/σ. Returns inf where e^{1/σ²} overflows (σ below ~0.027).
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q, k = _check_sample_rate(sample_rate), _check_steps(steps)
    try:
        growth = math.expm1(sigma**-2)
    except OverflowError:
        return math.inf
    return q * math.sqrt(k * growth)


def clt_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """σ the paper uses for a target (ε, δ) (Algorithm 1 lines 1-2): σ = 1/√(ln(1 + μ_tot²/(q²·K))).

    μ_tot = gdp_mu(ε, δ). The result is the CLT's calibration, not one that makes the release (ε, δ)-DP.
    """
    epsilon, delta = _check_epsilon(epsilon), _check_delta(delta)
    q, k = _check_sample_rate(sample_rate), _check_steps(steps)
    if epsilon == 0:
        raise ValueError("epsilon must be > 0 to calibrate a noise multiplier (ε = 0 needs infinite noise).")
    mu_tot = gdp_mu(epsilon, delta)
    return 1.0 / math.sqrt(math.log1p(mu_tot**2 / (q**2 * k)))


def clt_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """The paper's CLT ε for K releases at (σ, q) and δ: gdp_epsilon(clt_mu(σ, q, K), δ). An estimate only.

    It under-states the exact ε when 1/σ is not small (§6.1(c)); never report it as a guarantee.
    """
    delta = _check_delta(delta)
    mu_tot = clt_mu(noise_multiplier, sample_rate, steps)
    if math.isinf(mu_tot):
        return math.inf
    return gdp_epsilon(mu_tot, delta)
