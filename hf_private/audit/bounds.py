"""The statistics of an audit: from guesses about canaries to a lower bound on ε, with no model in sight.

Kept apart from the canaries and the trainer so that every test which turns counts into an ε (the one-run audit,
the one-step distinguisher of each method's conformance test) uses the same few formulas, testable on numbers alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from scipy import stats

_EPSILON_CEILING = 1e3  # bisection stops here; no finite number of guesses supports more
_MU_FLOOR, _MU_CEILING = 1e-3, 64.0  # μ-GDP bisection range (μ = 64 is ε ≈ 2000 at δ = 1e-5)
_GDP_GRID = 64  # ε points at which a μ-GDP profile is tested


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """p-value of "training is (ε, δ)-DP per canary" given `correct` right out of `guesses` non-abstaining guesses.

    Steinke et al. (2023), Theorem 5.2: P[V ≥ v] ≤ P[Bin(r, q) ≥ v] + 2mδ·max_{1≤i≤v} (1/i)·P[v > Bin(r, q) ≥ v−i]
    with q = e^ε / (1 + e^ε).
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"Need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}.")
    if correct == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    p_value = float(stats.binom.sf(correct - 1, guesses, q))
    if delta > 0:
        below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)  # P[Bin = v−1], P[Bin = v−2], ...
        worst = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
        p_value += 2 * canaries * delta * worst
    return min(1.0, p_value)


def one_run_epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """sup{ε : p(ε) < 1 − confidence}, by bisection; 0 when not even ε = 0 is rejected."""
    check_confidence(confidence)
    beta = 1.0 - confidence
    return _largest_rejected(
        lambda epsilon: one_run_p_value(canaries, guesses, correct, epsilon, delta) < beta,
        0.0,
        _EPSILON_CEILING,
        steps=60,
    )


def _largest_rejected(rejected: Callable[[float], bool], floor: float, ceiling: float, steps: int) -> float:
    """sup{x : rejected(x)} for a hypothesis rejected below some edge (p-values grow with x): doubling from 1 up to
    `ceiling`, then `steps` bisections; 0 when not even `floor` is rejected."""
    if not rejected(floor):
        return 0.0
    low, high = floor, 1.0
    while rejected(high) and high < ceiling:
        low, high = high, 2 * high
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth, Su 2022, Corollary 2.13): Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)."""
    if mu <= 0:
        return 0.0
    tail = math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2))
    return max(0.0, float(stats.norm.cdf(-epsilon / mu + mu / 2)) - tail)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which μ-GDP's δ(ε) falls to `delta` (δ(ε) decreases in ε): μ read as an (ε, δ) figure."""
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gdp_delta(mu, high) > delta:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if gdp_delta(mu, middle) > delta else (low, middle)
    return high


def one_run_gdp_p_value(canaries: int, guesses: int, correct: int, mu: float, delta: float) -> float:
    """p-value of "training is μ-GDP per canary".

    μ-GDP is (ε, δ_μ(ε))-DP at every ε at once, so Steinke et al.'s bound on P[V ≥ v] holds at each ε of that
    profile, and so does its minimum over any fixed grid of ε: a valid p-value that uses the whole trade-off curve
    instead of one (ε, δ) point. The grid holds the point where the profile crosses the run's `delta`, so a μ whose
    ε there the (ε, δ) test rejects is rejected too. (Mahloujifar et al., ICML 2025, bound the same event through f
    directly, tighter.)
    """
    if correct == 0:
        return 1.0
    grid = [*np.linspace(0.0, mu * (mu / 2 + 4.0), _GDP_GRID), gdp_epsilon(mu, delta)]  # δ_μ < 1e-5 past the end
    return min(one_run_p_value(canaries, guesses, correct, float(e), gdp_delta(mu, float(e))) for e in grid)


def one_run_mu_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """sup{μ : the μ-GDP p-value < 1 − confidence}, by bisection; 0 when not even μ → 0 is rejected."""
    check_confidence(confidence)
    beta = 1.0 - confidence
    return _largest_rejected(
        lambda mu: one_run_gdp_p_value(canaries, guesses, correct, mu, delta) < beta, _MU_FLOOR, _MU_CEILING, steps=40
    )


def count_correct(scores: torch.Tensor, included: torch.Tensor, k_plus: int, k_minus: int) -> tuple[int, int]:
    """(guesses, correct): the k₊ highest scores are guessed "in", the k₋ lowest "out"; ties go by canary index."""
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.numel():
        raise ValueError(f"Need k_plus, k_minus ≥ 0 and k_plus + k_minus ≤ {scores.numel()} canaries.")
    order = torch.argsort(scores.detach().cpu().double(), descending=True, stable=True)
    included = included.cpu().bool()
    correct = int(included[order[:k_plus]].sum()) + int((~included[order[scores.numel() - k_minus :]]).sum())
    return k_plus + k_minus, correct


def epsilon_from_error_rates(
    false_positives: int,
    negatives: int,
    false_negatives: int,
    positives: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """ε lower bound from a threshold test's errors (Jagielski et al. 2020), Clopper–Pearson at `confidence`.

    (ε, δ)-DP forces FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ; both rates are replaced by their upper
    confidence bounds (each at half the miss probability), so the bound holds with the stated confidence.
    """
    check_confidence(confidence)
    half = (1.0 - confidence) / 2
    fpr = _clopper_pearson_upper(false_positives, negatives, half)
    fnr = _clopper_pearson_upper(false_negatives, positives, half)
    candidates = [math.log((1 - delta - a) / b) for a, b in ((fpr, fnr), (fnr, fpr)) if 1 - delta - a > 0 < b]
    return max([0.0, *candidates])


def _clopper_pearson_upper(errors: int, trials: int, alpha: float) -> float:
    if trials <= 0:
        raise ValueError("Clopper–Pearson needs at least one trial.")
    return 1.0 if errors >= trials else float(stats.beta.ppf(1 - alpha, errors + 1, trials - errors))


def check_confidence(confidence: float) -> None:
    """Refuse a confidence outside (0, 1), the same way for the bounds and for `run_audit`."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
