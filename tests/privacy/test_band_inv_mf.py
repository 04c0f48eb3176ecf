"""Banded-inverse MF (BISR, issue 50): sensitivity against a brute force, the two memory layouts, b = 1, accounting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from hf_private.privacy import band_inv_mf as bim
from hf_private.privacy import banded_inverse as bi
from hf_private.privacy.accountants import compute_epsilon, sampler_tail_delta
from hf_private.privacy.calibration import calibrate_noise_multiplier
from hf_private.privacy.rng import GaussianSampler, SecretRandom

SHAPES = [(70, 30), (5,), (1000,)]
PAIRS = 256  # small chunks: a tensor spans several requests


def _strategy(bands: int, n: int) -> np.ndarray:
    c = bi.strategy_coefficients(bands, n)
    return np.array([[c[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


def _patterns(n: int, separation: int):
    """Every non-empty set of steps whose gaps are all ≥ `separation` (b-min-sep participation)."""
    for size in range(1, n + 1):
        for steps in itertools.combinations(range(n), size):
            if all(b - a >= separation for a, b in zip(steps, steps[1:])):
                yield steps


@pytest.mark.parametrize(("bands", "n"), [(2, 9), (3, 10), (4, 11)])
def test_sensitivity_is_the_brute_force_maximum(bands, n):
    matrix = _strategy(bands, n)
    inverse = np.linalg.inv(matrix)
    assert np.allclose(inverse[:bands, 0], bi.bisr_coefficients(bands))  # C⁻¹: BISR's d on b bands, zero below
    assert np.allclose(np.tril(inverse, -bands), 0)
    patterns = list(_patterns(n, bands))
    norms = {steps: np.linalg.norm(matrix[:, list(steps)].sum(axis=1)) for steps in patterns}
    in_one_partition = [v for steps, v in norms.items() if len({s % bands for s in steps}) == 1]
    assert bi.sensitivity(bands, n) == pytest.approx(max(in_one_partition), rel=1e-12)  # what our sampler allows
    assert bi.sensitivity(bands, n) == pytest.approx(max(norms.values()), rel=1e-12)  # = b-min-sep's (BSR Thm 2)
    rng = np.random.default_rng(0)  # unit gradients in any directions never exceed it
    for steps in patterns:
        g = rng.normal(size=(len(steps), 3))
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        assert np.linalg.norm(matrix[:, list(steps)] @ g) <= bi.sensitivity(bands, n) * (1 + 1e-12)


def test_one_band_has_dp_sgds_unamplified_sensitivity():
    assert bi.sensitivity(1, 25) == pytest.approx(5.0)


def _run(layout: str, bands: int, steps: int = 6) -> list[torch.Tensor]:
    noise = bim.BandedInverseNoise(SecretRandom(test_seed=3), bands, PAIRS, layout=layout)
    out = []
    for _ in range(steps):
        totals = [torch.zeros(shape) for shape in SHAPES]
        noise.add_(totals, 0.7)
        out.append(torch.cat([t.view(-1) for t in totals]))
    return out


def test_store_and_regenerate_give_the_same_noise_bit_for_bit():
    stored, regenerated = _run("store", 4), _run("regenerate", 4)
    assert all(torch.equal(a, b) for a, b in zip(stored, regenerated))
    assert not torch.equal(stored[3], stored[4])


def test_noise_is_the_finite_filter_of_dp_sgds_draws():
    sampler = GaussianSampler(SecretRandom(test_seed=3), PAIRS)  # DP-SGD's sampler, the same chunks
    draws = []
    for _ in range(6):
        totals = [torch.zeros(shape) for shape in SHAPES]
        for tensor in totals:
            sampler.add_(tensor, 0.7)
        draws.append(torch.cat([t.view(-1) for t in totals]))
    assert all(torch.equal(a, b) for a, b in zip(_run("store", 1), draws))  # b = 1: DP-SGD's noise bit for bit
    d = bi.bisr_coefficients(4)
    for t, w in enumerate(_run("regenerate", 4)):
        expected = sum(float(d[j]) * draws[t - j].double() for j in range(min(4, t + 1)))
        assert torch.allclose(w.double(), expected, atol=1e-5)


def test_auto_layout_stores_small_releases_and_regenerates_large(monkeypatch):
    noise = bim.BandedInverseNoise(SecretRandom(test_seed=1), 4, PAIRS)
    noise.add_([torch.zeros(100)], 1.0)
    assert noise.layout == "store"
    monkeypatch.setattr(bim, "STORE_LIMIT_BYTES", 3 * 4 * 100 - 1)
    noise = bim.BandedInverseNoise(SecretRandom(test_seed=1), 4, PAIRS)
    noise.add_([torch.zeros(100)], 1.0)
    assert noise.layout == "regenerate"


def test_checkpoint_round_trip_continues_and_refuses_another_b():
    reference = _run("regenerate", 3, steps=5)
    first = bim.BandedInverseNoise(SecretRandom(test_seed=3), 3, PAIRS, layout="regenerate")
    for _ in range(3):
        first.add_([torch.zeros(shape) for shape in SHAPES], 0.7)
    state = first.state_dict()
    assert len(state["history"]) == 2
    resumed = bim.BandedInverseNoise(SecretRandom(test_seed=3), 3, PAIRS, layout="regenerate")
    resumed.random.reserve_requests(first.random.reserve_requests(0))  # the same stream position, for the test
    resumed.load_state_dict(state)
    for t in (3, 4):
        totals = [torch.zeros(shape) for shape in SHAPES]
        resumed.add_(totals, 0.7)
        assert torch.equal(torch.cat([x.view(-1) for x in totals]), reference[t])
    with pytest.raises(ValueError, match="bands=3.*bands=4"):
        bim.BandedInverseNoise(SecretRandom(test_seed=3), 4, PAIRS).load_state_dict(state)


def test_epsilon_is_one_unamplified_gaussian_at_sigma_over_sensitivity():
    sigma, bands, steps, delta = 40.0, 4, 60, 1e-5
    event = bim.band_inv_mf_event("band-inv-mf", sigma, 0.1, bands, steps)
    card = bim.card_release(event.to_dict())
    assert card["steps"] == 1 and card["sample_rate"] == 1.0 and card["training_steps"] == steps
    assert card["noise_multiplier"] == pytest.approx(sigma / bi.sensitivity(bands, steps))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_event.GaussianDpEvent(card["noise_multiplier"]))  # from the card's entry alone
    reference = accountant.get_epsilon(delta - sampler_tail_delta([event], delta))
    assert compute_epsilon([event], delta, "prv") == pytest.approx(reference, rel=0.02)
    longer = bim.band_inv_mf_event("band-inv-mf", sigma, 0.1, bands, 2 * steps)
    assert compute_epsilon([longer], delta, "prv") > compute_epsilon([event], delta, "prv")


def test_one_band_is_accounted_as_dp_sgd():
    event = bim.band_inv_mf_event("band-inv-mf", 1.0, 0.01, 1, 100)
    assert event.mechanism == "poisson_gaussian" and event.bands is None


def test_calibration_meets_the_target():
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.1, 50, bands=4, banded_inverse=True)
    spent = compute_epsilon([bim.band_inv_mf_event("band-inv-mf", sigma, 0.1, 4, 50)], 1e-5, "prv")
    assert 2.9 <= spent <= 3.0
