"""Amplified BandMF (issue 50, part 1): the strategy, the streaming noise, the partitioned sampler, the accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from torch import nn

from hf_private.data.sampling import PartitionedPoissonBatchSampler, band_partitions
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy import GaussianNoise
from hf_private.privacy import band_mf as bm
from hf_private.privacy.accountants import compute_epsilon, sampler_tail_delta
from hf_private.privacy.calibration import calibrate_noise_multiplier
from hf_private.privacy.events import MechanismGroup
from hf_private.privacy.rng import SecretRandom


# ---------------------------------------------------------------------------------------------- the strategy
def test_one_band_is_the_identity():
    assert bm.strategy(50, 1).tolist() == [1.0]
    assert torch.equal(bm.strategy_matrix([1.0], 6), torch.eye(6, dtype=torch.float64))


def test_optimised_strategy_is_banded_normalised_and_beats_dp_sgd(tmp_path):
    n, b = 64, 4
    c = bm.strategy(n, b, cache_dir=tmp_path)
    matrix = bm.strategy_matrix(c, n)
    assert torch.equal(matrix, torch.tril(matrix))  # lower triangular
    rows, cols = torch.nonzero(matrix, as_tuple=True)
    assert int((rows - cols).max()) == b - 1  # b bands, no more
    assert float(matrix.norm(dim=0).max()) <= 1 + 1e-12  # column norms ≤ 1 (the sensitivity the theorem assumes)
    identity = bm.prefix_loss([1.0], n)
    assert identity == pytest.approx(n * (n + 1) / 2)
    loss = bm.prefix_loss(c, n)
    assert loss < 0.5 * identity  # the factorization loss alone, sampling rates aside
    # the loss is ‖A C⁻¹‖_F² computed densely
    workload = torch.tril(torch.ones(n, n, dtype=torch.float64))
    assert float((workload @ torch.linalg.inv(matrix)).square().sum()) == pytest.approx(loss, rel=1e-9)
    # cached on disk, keyed by (n, b): the second call reads the same coefficients
    assert len(list(tmp_path.iterdir())) == 1
    assert bm.strategy(n, b, cache_dir=tmp_path).tolist() == c.tolist()


def test_loss_gradient_matches_finite_differences():
    theta = np.array([0.8, 0.4, 0.2])
    _, grad = bm._normalised_loss_and_grad(theta, 40)
    for j in range(3):
        step = np.zeros(3)
        step[j] = 1e-6
        numeric = (
            bm._normalised_loss_and_grad(theta + step, 40)[0] - bm._normalised_loss_and_grad(theta - step, 40)[0]
        ) / 2e-6
        assert grad[j] == pytest.approx(numeric, rel=1e-5)


# ---------------------------------------------------------------------------------------------- the noise
def test_streaming_noise_is_the_closed_form_inverse():
    c = bm.strategy(12, 3)
    z = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    banded = bm.BandedNoise(c)
    streamed = []
    for t in range(12):
        noise = [z[t].clone()]
        banded.correlate_(noise)
        streamed.append(noise[0])
    expected = torch.linalg.solve_triangular(bm.strategy_matrix(c, 12), z, upper=False)
    torch.testing.assert_close(torch.stack(streamed), expected, rtol=1e-12, atol=1e-12)


def test_state_round_trip_continues_the_sequence_and_refuses_another_b():
    c = bm.strategy(10, 3)
    z = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole, first = bm.BandedNoise(c), bm.BandedNoise(c)
    straight = []
    for t in range(10):
        noise = [z[t].clone()]
        whole.correlate_(noise)
        straight.append(noise[0])
    for t in range(4):
        first.correlate_([z[t].clone()])
    resumed = bm.BandedNoise(c)
    resumed.load_state_dict(first.state_dict())
    for t in range(4, 10):
        noise = [z[t].clone()]
        resumed.correlate_(noise)
        assert torch.equal(noise[0], straight[t])
    with pytest.raises(ValueError, match="bands=3.*bands=2"):
        bm.BandedNoise(bm.strategy(10, 2)).load_state_dict(first.state_dict())


class _Engine:
    """The two things NoisyOptimizer reads from an engine, with fixed clipped sums."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.parameters = [(str(i), p) for i, p in enumerate(params)]

    def pop_clipped_sums(self):
        return {p: torch.full(p.shape, 0.5) for _, p in self.parameters}

    def reset(self) -> None:
        pass


def _released(banded: bm.BandedNoise | None, steps: int = 3) -> list[torch.Tensor]:
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))]
    optimizer = NoisyOptimizer(
        torch.optim.SGD(params, lr=1.0),
        _Engine(params),  # type: ignore[arg-type]
        noise_multiplier=1.3,
        max_grad_norm=0.7,
        expected_batch_size=4,
        noise=GaussianNoise("cpu", test_seed=11),
        may_step=lambda: True,
        on_step=lambda: None,
    )
    optimizer.banded_noise = banded
    released = []
    for _ in range(steps):
        optimizer.step()
        released.append(torch.cat([p.grad.reshape(-1) for p in params]))
    return released


def test_one_band_releases_dp_sgds_updates_bit_for_bit():
    for ours, dp_sgd in zip(_released(bm.BandedNoise([1.0])), _released(None)):
        assert torch.equal(ours, dp_sgd)


def test_optimizer_adds_the_correlated_noise():
    c = bm.strategy(8, 2)
    dp_sgd, ours = _released(None), _released(bm.BandedNoise(c))
    # same z_t (the same secret stream, drawn in the same order), then w = C⁻¹z: recover z from the DP-SGD run
    z = torch.stack([g * 4 - 0.5 for g in dp_sgd]).double()
    w = torch.linalg.solve_triangular(bm.strategy_matrix(c, 3), z, upper=False)
    torch.testing.assert_close(torch.stack([g * 4 - 0.5 for g in ours]).double(), w, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours[1], dp_sgd[1])


# ---------------------------------------------------------------------------------------------- sampling
def test_partitioned_sampling_keeps_each_example_in_its_partitions_steps():
    n, b, batch = 600, 3, 20
    random = SecretRandom(test_seed=5)
    partitions = band_partitions(n, b, random)
    assert set(partitions.tolist()) == {0, 1, 2}
    counter = {"t": 0}
    sampler = PartitionedPoissonBatchSampler(
        n, b * batch / n, 60, random=random, partitions=partitions, bands=b, step=lambda: counter["t"]
    )
    sizes = []
    for t, indices in enumerate(sampler):
        assert all(int(partitions[i]) == t % b for i in indices)  # b-min-sep: only partition t mod b
        sizes.append(len(indices))
        counter["t"] += 1
    # expected batch B: |partition| · q̂ ≈ N/b · bB/N (the partitions are i.i.d. uniform)
    assert np.mean(sizes) == pytest.approx(batch, rel=0.2)


# ---------------------------------------------------------------------------------------------- accounting
def test_epsilon_is_dp_sgds_at_the_partition_rate_over_the_rounds():
    n, b, q_hat, sigma, delta = 100, 4, 0.08, 1.1, 1e-5
    event = bm.band_mf_event("band-mf", sigma, q_hat, b, n)
    rounds = math.ceil(n / b)
    # the tail of the sampler counts all n draws
    assert sampler_tail_delta([event], delta) == sampler_tail_delta([MechanismGroup("x", sigma, q_hat, n)], delta)
    ours = compute_epsilon([event], delta, "prv")
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(dp_event.PoissonSampledDpEvent(q_hat, dp_event.GaussianDpEvent(sigma)), rounds)
    independent = accountant.get_epsilon(delta - sampler_tail_delta([event], delta))
    assert ours == pytest.approx(independent, rel=0.02)
    assert ours < compute_epsilon([MechanismGroup("dp-sgd", sigma, q_hat, n)], delta, "prv")
    assert MechanismGroup.from_dict(event.to_dict()) == event


def test_calibration_meets_the_target():
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.08, 100, bands=4)
    assert compute_epsilon([bm.band_mf_event("b", sigma, 0.08, 4, 100)], 1e-5, "prv") <= 3.0
    assert compute_epsilon([bm.band_mf_event("b", sigma * 0.97, 0.08, 4, 100)], 1e-5, "prv") > 3.0


def test_event_validation():
    with pytest.raises(ValueError, match="bands"):
        MechanismGroup("x", 1.0, 0.1, 3, bands=2)
    with pytest.raises(ValueError, match="positive integer"):
        bm.band_mf_event("x", 1.0, 0.1, 0, 3)


def test_step_noise_factor_is_the_std_a_late_step_adds():
    """The factor in the log and on the card is ‖row n of C⁻¹‖, the std of step n's noise per σ·C: 1 for one band
    (DP-SGD), above 1 for a real strategy (its columns have norm 1, so C⁻¹'s rows are longer)."""
    from hf_private.privacy import banded_inverse

    n = 40
    c = bm.optimise_strategy(n, 4)
    rows = torch.linalg.inv(bm.strategy_matrix(c, n))
    assert bm.step_noise_factor(c, n) == pytest.approx(float(rows[-1].norm()), rel=1e-10)
    assert bm.step_noise_factor([1.0], n) == 1.0 and bm.step_noise_factor(c, n) > 1.2
    d = banded_inverse.bisr_coefficients(6)
    inverse = torch.linalg.inv(bm.strategy_matrix(banded_inverse.strategy_coefficients(6, n), n))
    assert banded_inverse.step_noise_factor(6) == pytest.approx(float(inverse[-1].norm()), rel=1e-9)
    assert banded_inverse.step_noise_factor(6) == pytest.approx(float((d**2).sum() ** 0.5))
