"""DP-FROST's partition selection arithmetic: PGM-EST (Algorithm 5), σ_v (Lemma 6) and one round of PSEL (Algorithm 4).

These functions see only the noisy PGM observations, their sensitivities and the public partition sizes, so they are
post-processing of already-privatised releases and cost no privacy budget.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np


def estimate_pgms(
    observations: Sequence[np.ndarray],
    deltas: Sequence[float],
    sample_rate: float,
    iterations: int = 1000,
    tolerance: float = 1e-10,
) -> tuple[np.ndarray, np.ndarray]:
    """PGM-EST (Algorithm 5 with Lemmas 4-5). observations[t'] is ṽ_{t'+1}, a length-M float array with NaN for the
    partitions not observed in that round (not in R_{t'}); deltas[t'] = Δ_{t'+1}. Returns (v, lambdas): v has
    length M (NaN where a partition was never observed), lambdas[0] == sample_rate (λ₁ = q_ps fixed), others fitted.
    t = 1: v = ṽ₁ / q_ps (the scaled form). Else block-coordinate ascent, J iterations (early stop when the max change
    < tolerance), guard: keep the previous λ when Σ v_i² over that round's observed partitions is 0.

    The observed sets must be nested (R_t ⊆ R_{t-1}), as PSEL makes them. Each iteration adds one more exact block
    step, a common rescaling of v and λ_{≥2} fitted to round 1. It has the same maximiser; in our simulations it
    converges within 100 iterations where the listing's two blocks alone needed 1000-3000."""
    if len(observations) == 0:
        raise ValueError("estimate_pgms needs at least one round of observations")
    if len(observations) != len(deltas):
        raise ValueError(f"{len(observations)} rounds of observations but {len(deltas)} sensitivities")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    rows = [np.asarray(o, dtype=np.float64) for o in observations]
    if any(row.ndim != 1 or row.shape != rows[0].shape for row in rows):
        raise ValueError(f"every round's observations must be 1-D of one length M, got {[r.shape for r in rows]}")
    obs = np.stack(rows)
    observed = ~np.isnan(obs)
    if not np.isfinite(obs[observed]).all():
        raise ValueError("observations must be finite or NaN (not observed)")
    if (observed[1:] & ~observed[:-1]).any():
        raise ValueError("observed sets must be nested: a partition left out of a round cannot be observed later")
    delta = np.asarray(deltas, dtype=np.float64)
    if not (np.isfinite(delta) & (delta > 0)).all():
        raise ValueError(f"sensitivities must be positive and finite, got {list(deltas)}")

    if len(obs) == 1:
        return obs[0] / sample_rate, np.array([sample_rate])

    weights = 1.0 / delta**2
    filled = np.where(observed, obs, 0.0)
    ever = observed[0]  # nested sets: observed at all iff observed in round 1, where λ₁ = q_ps > 0
    lambdas = np.ones(len(obs))
    lambdas[0] = sample_rate
    v = np.zeros(obs.shape[1])
    for _ in range(iterations):
        # Lemma 5: v_i given λ, over T_i = the rounds that observed partition i.
        numerator = (filled * (lambdas * weights)[:, None]).sum(axis=0)
        denominator = (observed * (lambdas**2 * weights)[:, None]).sum(axis=0)
        new_v = np.divide(numerator, denominator, out=np.zeros_like(v), where=ever)
        # Lemma 4: λ_j given v over R_{j-1}, for j ≥ 2; guard: keep λ_j when Σ v_i² = 0.
        squares = (observed[1:] * new_v**2).sum(axis=1)
        new_lambdas = lambdas.copy()
        np.divide((filled[1:] * new_v).sum(axis=1), squares, out=new_lambdas[1:], where=squares > 0)
        # Scale block [deviation, same maximiser]: (c·v, λ₁, λ_{j≥2}/c) leaves rounds ≥ 2 unchanged, and c is the
        # round-1 least-squares fit. Without it the ascent crawls along this direction (λ₁ = q_ps is far below the
        # initial λ_j = 1) and J = 1000 iterations can stop far from the maximum.
        norm = new_v @ new_v
        scale = (filled[0] @ new_v) / (sample_rate * norm) if norm > 0 else 0.0
        if scale != 0:
            new_v *= scale
            new_lambdas[1:] /= scale
        change = max(np.abs(new_v - v).max(), np.abs(new_lambdas - lambdas).max())
        v, lambdas = new_v, new_lambdas
        if change < tolerance:
            break
    return np.where(ever, v, np.nan), lambdas


def pgm_std(noise_multiplier: float, lambdas: Sequence[float] | np.ndarray, deltas: Sequence[float]) -> float:
    """σ_v of Lemma 6: sqrt(σ_ps² / Σ_{t'} λ_{t'}² / Δ_{t'}²)."""
    if len(lambdas) == 0 or len(lambdas) != len(deltas):
        raise ValueError(f"need equally many (>= 1) scales and sensitivities, got {len(lambdas)} and {len(deltas)}")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    delta = np.asarray(deltas, dtype=np.float64)
    if not (np.isfinite(delta) & (delta > 0)).all():
        raise ValueError(f"sensitivities must be positive and finite, got {list(deltas)}")
    information = float((np.asarray(lambdas, dtype=np.float64) ** 2 / delta**2).sum())
    if not information > 0:
        raise ValueError("Σ λ²/Δ² must be positive")
    return math.sqrt(noise_multiplier**2 / information)


def select_round(
    v: np.ndarray,
    remaining: Sequence[int],
    selected: Sequence[int],
    sizes: np.ndarray,
    total_size: int,
    round_index: int,
    rounds: int,
    unfreeze_ratio: float,
    gap_coefficient: float,
    sigma_v: float,
    skip_oversized: bool = False,
) -> list[int]:
    """Lines 11-23 of PSEL (Algorithm 4) for round t = round_index (1-based) of T = rounds: the partitions of
    `remaining` (indices into v/sizes) newly selected this round, in the order chosen. `selected` is S_{t-1} (counts
    against the budget t·γ·|Θ|/T); total_size is |Θ|. Paper behaviour: the loop stops at the first candidate that does
    not fit the budget; skip_oversized=True skips it and goes on.

    Ties in v keep the order of `remaining` in the (stable) ascending sort, so among equal v the partition listed
    later in `remaining` is taken first. If `remaining` holds fewer than (1-γ)|Θ| parameters, μ_thres is its largest v
    (all of it is expected to stay frozen)."""
    v = np.asarray(v, dtype=np.float64)
    sizes = np.asarray(sizes)
    if v.ndim != 1 or sizes.shape != v.shape:
        raise ValueError(f"v and sizes must be 1-D of equal length, got shapes {v.shape} and {sizes.shape}")
    if not (sizes > 0).all():
        raise ValueError("partition sizes must be positive")
    rem = [operator.index(i) for i in remaining]
    sel = [operator.index(i) for i in selected]
    for name, idx in (("remaining", rem), ("selected", sel)):
        if any(not 0 <= i < len(v) for i in idx):
            raise ValueError(f"{name} holds an index outside [0, {len(v)})")
        if len(set(idx)) != len(idx):
            raise ValueError(f"{name} holds a duplicate index")
    if set(rem) & set(sel):
        raise ValueError(f"partitions {sorted(set(rem) & set(sel))} are both remaining and selected")
    if not np.isfinite(v[rem]).all():
        raise ValueError("every remaining partition needs a finite estimate v")
    if total_size < sizes[rem].sum() + sizes[sel].sum():
        raise ValueError(f"total_size {total_size} is smaller than the partitions it should contain")
    if not 1 <= round_index <= rounds:
        raise ValueError(f"round_index must be in [1, rounds={rounds}], got {round_index}")
    if not 0 < unfreeze_ratio <= 1:
        raise ValueError(f"unfreeze_ratio must be in (0, 1], got {unfreeze_ratio}")
    if not gap_coefficient >= 0:
        raise ValueError(f"gap_coefficient must be >= 0, got {gap_coefficient}")
    if not (math.isfinite(sigma_v) and sigma_v >= 0):
        raise ValueError(f"sigma_v must be finite and >= 0, got {sigma_v}")
    if not rem:
        return []

    order = np.asarray(rem)[np.argsort(v[rem], kind="stable")]  # lines 11-12
    reached = np.flatnonzero(np.cumsum(sizes[order]) >= (1 - unfreeze_ratio) * total_size)  # lines 13-17
    threshold = v[order[reached[0]] if reached.size else order[-1]]  # line 18
    budget = round_index * unfreeze_ratio * total_size / rounds
    used = sizes[sel].sum()
    chosen: list[int] = []
    for i in order[::-1]:  # lines 19-23, j = |R| down to 1
        if used + sizes[i] > budget:
            if skip_oversized:
                continue
            break
        if round_index == rounds or v[i] > threshold + gap_coefficient * sigma_v:
            chosen.append(int(i))
            used += sizes[i]
    return chosen
