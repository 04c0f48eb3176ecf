"""DP-FROST's selection arithmetic (PGM-EST, Lemma 6, one PSEL round) on hand-built inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import least_squares

from hf_private.methods.frost.selection import estimate_pgms, pgm_std, select_round

Q = 0.02


def _noisy_rounds(rng, v, lambdas, deltas, sigma, dropped_per_round):
    """Observations ṽ_t = λ_t·v + N(0, σ²Δ_t²) on nested remaining sets; partitions drop out in index order."""
    observed = np.ones((len(lambdas), len(v)), dtype=bool)
    for t in range(1, len(lambdas)):
        observed[t, : t * dropped_per_round] = False
    clean = np.outer(lambdas, v) + sigma * np.asarray(deltas)[:, None] * rng.standard_normal(observed.shape)
    return np.where(observed, clean, np.nan), observed


def _log_likelihood(obs, observed, deltas, sigma, v, lambdas):
    """ℓ of methods_spec §2.4, summed over the observed (round, partition) pairs."""
    scale = sigma * np.asarray(deltas)[:, None] * np.ones_like(obs)
    residual = (obs - np.outer(lambdas, v))[observed] / scale[observed]
    return float(-np.log(scale[observed] * math.sqrt(2 * math.pi)).sum() - 0.5 * (residual**2).sum())


def test_first_round_is_scaled_by_sample_rate():
    """t = 1 returns ṽ₁/q_ps exactly (not the listing's unscaled ṽ₁), λ = (q_ps,), and NaN where unobserved."""
    obs = np.array([0.3, -0.01, np.nan, 0.07])
    v, lambdas = estimate_pgms([obs], [0.5], Q)
    np.testing.assert_array_equal(v, obs / Q)
    np.testing.assert_array_equal(lambdas, [Q])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimate_is_the_maximum_likelihood(seed):
    """At t = 4 with partitions dropping out, (v, λ) is scipy's maximiser of ℓ (λ₁ = q_ps), within 100 iterations."""
    rng = np.random.default_rng(seed)
    sigma, deltas = 0.01, np.array([1.0, 0.8, 0.6, 0.5])
    true_v = rng.uniform(0.5, 2.0, 12)
    obs, observed = _noisy_rounds(rng, true_v, [Q, 0.03, 0.05, 0.04], deltas, sigma, dropped_per_round=3)

    v, lambdas = estimate_pgms(list(obs), deltas, Q)
    v_short, lambdas_short = estimate_pgms(list(obs), deltas, Q, iterations=100)

    def residuals(x):  # ℓ = const − ½‖residuals‖², so least squares maximises ℓ
        return ((obs - np.outer(np.r_[Q, x[12:]], x[:12])) / (sigma * deltas[:, None]))[observed]

    start = np.r_[np.ones(12), np.full(3, 0.01)]
    fit = least_squares(residuals, start, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15)
    assert lambdas[0] == Q
    np.testing.assert_allclose(v, fit.x[:12], rtol=1e-7)
    np.testing.assert_allclose(lambdas[1:], fit.x[12:], rtol=1e-7)
    np.testing.assert_allclose(np.r_[v_short, lambdas_short], np.r_[v, lambdas], rtol=1e-7)  # converges fast
    ours = _log_likelihood(obs, observed, deltas, sigma, v, lambdas)
    theirs = _log_likelihood(obs, observed, deltas, sigma, fit.x[:12], np.r_[Q, fit.x[12:]])
    assert ours >= theirs - 1e-9 * abs(theirs)


def test_noiseless_observations_recover_v_and_lambda():
    """If ṽ_{t,i} = λ_t·v_i exactly, PGM-EST returns that v and λ, and NaN for a never-observed partition."""
    rng = np.random.default_rng(3)
    true_v, true_lambdas = rng.uniform(0.1, 5.0, 10), np.array([Q, 0.03, 0.05])
    obs, _ = _noisy_rounds(rng, true_v, true_lambdas, [1.0, 0.7, 0.4], sigma=0.0, dropped_per_round=3)
    obs[:, 9] = np.nan

    v, lambdas = estimate_pgms(list(obs), [1.0, 0.7, 0.4], Q)

    np.testing.assert_allclose(v[:9], true_v[:9], rtol=1e-9)
    assert np.isnan(v[9])
    np.testing.assert_allclose(lambdas, true_lambdas, rtol=1e-9)


def test_lambda_guard_keeps_previous_value():
    """A round that observes nothing, or only zero PGMs, keeps λ_j = 1 without warnings or NaN."""
    with np.errstate(all="raise"):
        v, lambdas = estimate_pgms([np.array([0.2, 0.4]), np.array([np.nan, np.nan])], [1.0, 1.0], Q)
        np.testing.assert_allclose(v, [10.0, 20.0])
        np.testing.assert_array_equal(lambdas, [Q, 1.0])
        v, lambdas = estimate_pgms([np.zeros(3), np.zeros(3)], [1.0, 1.0], Q)
        np.testing.assert_array_equal(v, np.zeros(3))
        np.testing.assert_array_equal(lambdas, [Q, 1.0])


def test_pgm_std_by_hand():
    """σ_v = σ_ps/sqrt(Σ λ²/Δ²): σ = 2, λ = (0.02, 0.5), Δ = (0.1, 0.2) gives 2/sqrt(0.04 + 6.25)."""
    assert pgm_std(2.0, [0.02, 0.5], [0.1, 0.2]) == pytest.approx(2 / math.sqrt(6.29), rel=1e-12)
    assert pgm_std(1.5, [Q], [0.3]) == pytest.approx(1.5 * 0.3 / Q, rel=1e-12)


@pytest.mark.parametrize("rounds", [1, 3])
def test_pgm_std_matches_the_spread_of_the_estimate(rounds):
    """Over 200 simulated PSELs the RMS error of v over the remaining partitions is within 10% of pgm_std."""
    rng = np.random.default_rng(rounds)
    sigma, deltas, true_lambdas = 0.05, [0.1, 0.09, 0.08][:rounds], [Q, 0.025, 0.03][:rounds]
    true_v = rng.uniform(1.0, 3.0, 100)
    errors, stds = [], []
    for _ in range(200):
        obs, observed = _noisy_rounds(rng, true_v, true_lambdas, deltas, sigma, dropped_per_round=10)
        v, lambdas = estimate_pgms(list(obs), deltas, Q)
        errors.append((v - true_v)[observed[-1]])
        stds.append(pgm_std(sigma, lambdas, deltas))
    ratio = math.sqrt(np.mean(np.concatenate(errors) ** 2)) / np.mean(stds)
    assert 0.9 < ratio < 1.1


# Θ = 100 parameters in 7 partitions. Ascending by v: 6 (15), 1 (15), 3 (20) reach (1 − 0.5)·100 = 50 exactly at
# partition 3, so μ_thres = 2.0 when γ = 0.5.
V = np.array([4.0, 1.0, 6.0, 2.0, 4.5, 3.0, 0.5])
SIZES = np.array([5, 15, 10, 20, 10, 25, 15])


def _select(
    v=V,
    sizes=SIZES,
    remaining=range(7),
    selected=(),
    total=100,
    t=1,
    rounds=2,
    gamma=0.5,
    nu=1.0,
    sigma_v=0.0,
    skip_oversized=False,
):
    return select_round(
        np.asarray(v, dtype=float),
        list(remaining),
        list(selected),
        np.asarray(sizes),
        total,
        t,
        rounds,
        gamma,
        nu,
        sigma_v,
        skip_oversized=skip_oversized,
    )


def test_threshold_is_v_where_cumulative_size_reaches_frozen_share():
    """μ_thres = 2.0 (not 3.0 or 1.0): with ν·σ_v = 2.2 exactly partitions 2 (v = 6) and 4 (v = 4.5) pass, not 0."""
    assert _select(sigma_v=2.2) == [2, 4]


def test_gap_test_before_last_round_is_strict():
    """At t < T only v > μ_thres + ν·σ_v is taken: a cut of 2 + 2·1.25 = 4.5 excludes v = 4.5, 4.4 includes it."""
    assert _select(nu=2.0, sigma_v=1.25) == [2]
    assert _select(nu=2.0, sigma_v=1.2) == [2, 4]


def test_last_round_fills_greedily():
    """At t = T the gap test is off: descending v up to γ|Θ| = 50 (10 + 10 + 5 + 25), stopping at partition 3."""
    assert _select(t=2, rounds=2, sigma_v=100.0) == [2, 4, 0, 5]


def test_budget_is_cumulative_and_counts_already_selected():
    """The budget is t·γ·|Θ|/T and includes S_{t-1}: a candidate that lands exactly on it fits, the next does not."""
    assert _select(t=1, rounds=4, nu=0.0) == [2]  # budget 12.5
    assert _select(t=3, rounds=4, nu=0.0) == [2, 4, 0]  # budget 37.5; partition 5 (v = 3 > 2) would make 50
    remaining = [0, 1, 2, 3, 4, 6]
    assert _select(remaining=remaining, t=2, rounds=2) == [2, 4, 0, 3]
    assert _select(remaining=remaining, selected=[5], t=2, rounds=2) == [2, 4, 0]  # 25 + 10 + 10 + 5 = 50


def test_oversized_candidate_stops_the_loop_unless_skipped():
    """A top-ranked partition larger than the budget ends selection (paper); skip_oversized passes over every misfit."""
    v, sizes = [5.0, 4.0, 3.0, 2.0, 1.0], [40, 10, 20, 15, 15]
    assert _select(v=v, sizes=sizes, remaining=range(5), t=1, rounds=1, gamma=0.25) == []
    assert _select(v=v, sizes=sizes, remaining=range(5), t=1, rounds=1, gamma=0.25, skip_oversized=True) == [1, 3]


def test_everything_fits_without_running_off_the_end():
    """With budget |Θ| (γ = 1, t = T) the j ≥ 1 guard ends the loop after the last partition: all, by descending v."""
    kwargs = dict(v=[2.0, 1.0, 3.0], sizes=[10, 20, 30], remaining=range(3), total=60)
    assert _select(t=1, rounds=1, gamma=1.0, **kwargs) == [2, 0, 1]


def test_remaining_smaller_than_frozen_share():
    """If R holds < (1−γ)|Θ| parameters, μ_thres is its largest v: nothing passes at t < T, greedy fill at t = T."""
    kwargs = dict(v=[1.0, 2.0, 3.0], sizes=[10, 10, 10], remaining=range(3), total=100, gamma=0.25, nu=0.0)
    assert _select(t=1, rounds=2, **kwargs) == []
    assert _select(t=1, rounds=1, **kwargs) == [2, 1]


def test_ties_follow_the_order_of_remaining():
    """Equal v sort stably, so the tied partition listed later in `remaining` is taken first, reproducibly."""
    kwargs = dict(v=[1.0, 2.0, 2.0, 0.5], sizes=[10, 10, 10, 10], total=40, t=1, rounds=1, gamma=0.25)
    assert _select(remaining=[0, 1, 2, 3], **kwargs) == [2]
    assert _select(remaining=[0, 2, 1, 3], **kwargs) == [1]
    remaining = np.random.default_rng(0).permutation(40)  # 20 ties at v = 1, budget 0.125·40 = 5
    v = np.r_[np.ones(20), np.zeros(20)]
    tied = [int(i) for i in remaining if v[i] == 1]
    assert _select(v=v, sizes=np.ones(40), remaining=remaining, total=40, t=1, rounds=1, gamma=0.125) == tied[::-1][:5]


@pytest.mark.parametrize(
    "call",
    [
        lambda: estimate_pgms([], [], Q),
        lambda: estimate_pgms([np.ones(3)], [1.0, 1.0], Q),
        lambda: estimate_pgms([np.ones(3), np.ones(4)], [1.0, 1.0], Q),
        lambda: estimate_pgms([np.ones(3)], [1.0], 0.0),
        lambda: estimate_pgms([np.ones(3)], [1.0], 1.5),
        lambda: estimate_pgms([np.ones(3)], [0.0], Q),
        lambda: estimate_pgms([np.array([1.0, np.inf])], [1.0], Q),
        lambda: estimate_pgms([np.array([1.0, np.nan]), np.ones(2)], [1.0, 1.0], Q),  # not nested
        lambda: pgm_std(1.0, [Q, 0.1], [1.0]),
        lambda: pgm_std(-1.0, [Q], [1.0]),
        lambda: _select(remaining=[0, 1], selected=[1]),
        lambda: _select(remaining=[0, 0]),
        lambda: _select(remaining=[7]),
        lambda: _select(sizes=SIZES[:6]),
        lambda: _select(total=50),
        lambda: _select(t=0),
        lambda: _select(t=3, rounds=2),
        lambda: _select(gamma=0.0),
        lambda: _select(gamma=1.5),
        lambda: _select(sigma_v=-1.0),
        lambda: _select(v=np.r_[V[:6], np.nan]),
    ],
)
def test_invalid_inputs_are_rejected(call):
    """Mismatched lengths, out-of-range rates/rounds/indices, overlaps and non-finite values raise ValueError."""
    with pytest.raises(ValueError):
        call()
