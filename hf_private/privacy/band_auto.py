"""`bands="auto"`: the number of BandMF bands b with the least expected error for this run's ε, δ, steps, B and N.

Choquette-Choo et al. 2023 (arXiv 2306.08153, §5) choose b by the expected error of the released prefix sums at the
run's privacy level: for each b, σ_b is calibrated for the target (ε, δ) with b's amplified accounting (⌈n/b⌉
Poisson-Gaussian releases at q̂ = b·B/N, as the plan will calibrate it), and the error is σ_b² · ‖A C_b⁻¹‖_F²
(`band_mf.prefix_loss` of the optimised strategy, columns of norm 1, i.e. sensitivity 1). A larger b correlates more
but samples each partition at a higher rate q̂, so amplification weakens: the error has an interior minimum.

Candidates are the powers of two up to min(n, `MAX_AUTO_BANDS`, ⌊N/B⌋) (q̂ ≤ 1). Powers of two: each candidate costs a
σ calibration and a strategy optimisation (cached by (n, b)), and the error varies slowly in b near its minimum
(the paper's sweeps use such grids), so seven candidates cover 1..64 at a fraction of the cost of all 64. 64 caps the
memory BandMF's history takes (b − 1 copies of the trainable size). Measured in a fresh process on the shared 2-core
CPU under load 7-14 (other jobs running), PRV accountant, ε = 8, δ = 1e-5, B = 256, N = 67,349 (7 candidates): n = 10³
steps 29.9 s with the strategy cache cold, 17.1 s warm; n = 10⁴ steps 25.0 s cold, 15.2 s warm. The σ calibrations
dominate (the strategies for 10⁴ steps take 0.1-0.8 s each); a second choice in the same process took 4-6 s.

The banded inverse (`noise_mechanism="band-inv-mf"`) is chosen the same way with its own accounting and error: σ_b
calibrated as one un-amplified Gaussian at σ_b / sensitivity (`banded_inverse`), and the error σ_b² · ‖A D_b‖_F² for
its banded C⁻¹ = D_b (BISR's coefficients); its b = 1 is DP-SGD, amplified. Without amplification its error falls
with b, but at small ε it may stay above DP-SGD's at every candidate: "auto" then keeps b = 1, DP-SGD, and says so.
On SST-2's 234 steps (B = 256, N = 20,000) it picked b = 64 at ε = 8 (error 2,841 against DP-SGD's 7,300) and b = 1
at ε = 3 and 1 (b = 64: 15,018 and 108,013 against 13,981 and 31,275).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from ..logs import get_logger
from .band_mf import BAND_MF_MECHANISM, filter_prefix_loss, prefix_loss, strategy
from .banded_inverse import bisr_coefficients
from .calibration import calibrate_noise_multiplier

logger = get_logger(__name__)

#: the largest b `bands="auto"` considers
MAX_AUTO_BANDS = 64


class Candidate(NamedTuple):
    """One row of the choice: b, its calibrated σ, and the expected total squared prefix-sum error σ²·‖A C⁻¹‖_F²."""

    bands: int
    noise_multiplier: float
    error: float


def candidate_bands(steps: int, expected_batch_size: int, dataset_size: int, cap: int = MAX_AUTO_BANDS) -> list[int]:
    """1, 2, 4, … up to min(steps, cap, ⌊N/B⌋): the b whose partitions are sampled at q̂ = b·B/N ≤ 1."""
    limit = max(1, min(int(steps), int(cap), int(dataset_size) // max(int(expected_batch_size), 1)))
    return [2**k for k in range(int(math.log2(limit)) + 1)]


def inverse_prefix_loss(bands: int, n: int) -> float:
    """‖A D‖_F² for the banded-inverse noise filter D (BISR's b coefficients): its expected prefix-sum error per unit
    of σ², as `band_mf.prefix_loss` is BandMF's."""
    return filter_prefix_loss(bisr_coefficients(min(int(bands), int(n))), n)


def _candidate(
    b: int,
    target_epsilon: float,
    delta: float,
    steps: int,
    expected_batch_size: int,
    dataset_size: int,
    accountant: str,
    inverse: bool,
) -> Candidate:
    """b's row for BandMF or (`inverse`) the banded inverse: its calibrated σ and expected error."""
    rate = b * expected_batch_size / dataset_size
    if inverse and b > 1:
        sigma = calibrate_noise_multiplier(
            target_epsilon, delta, rate, steps, accountant=accountant, name="band-inv-mf", bands=b, banded_inverse=True
        )
        return Candidate(b, sigma, sigma**2 * inverse_prefix_loss(b, steps))
    sigma = calibrate_noise_multiplier(
        target_epsilon, delta, rate, steps, accountant=accountant, name="band-mf", bands=b
    )
    return Candidate(b, sigma, sigma**2 * prefix_loss(strategy(steps, b), steps))


def choose_bands(
    target_epsilon: float,
    delta: float,
    steps: int,
    expected_batch_size: int,
    dataset_size: int,
    accountant: str = "prv",
    mechanism: str = BAND_MF_MECHANISM,
) -> tuple[int, list[Candidate]]:
    """The b of least expected error among `candidate_bands` for `mechanism` ("band-mf" or "band-inv-mf"), and the
    table of every candidate (logged at INFO; a warning when b = 1, DP-SGD, wins)."""
    started = time.perf_counter()
    inverse = mechanism != BAND_MF_MECHANISM
    table = [
        _candidate(b, target_epsilon, delta, steps, expected_batch_size, dataset_size, accountant, inverse)
        for b in candidate_bands(steps, expected_batch_size, dataset_size)
    ]
    best = min(table, key=lambda row: row.error)
    rows = "\n".join(f"  b={r.bands:3d}  σ={r.noise_multiplier:.4g}  error={r.error:.4g}" for r in table)
    logger.info(
        "bands='auto' (%s): b=%d chosen for %d steps at ε=%g in %.1f s (error = σ²·‖A C⁻¹‖_F²):\n%s",
        mechanism,
        best.bands,
        steps,
        target_epsilon,
        time.perf_counter() - started,
        rows,
    )
    if best.bands == 1 and len(table) > 1:
        runner_up = min(table[1:], key=lambda row: row.error)
        logger.warning(
            "bands='auto' (%s) chose b=1, which is DP-SGD: at ε=%g over %d steps no b up to %d lowers DP-SGD's "
            "expected error (%.4g; the least other: %.4g at b=%d). The run trains with DP-SGD's noise.",
            mechanism,
            target_epsilon,
            steps,
            table[-1].bands,
            best.error,
            runner_up.error,
            runner_up.bands,
        )
    return best.bands, table
