"""Banded-inverse factorization (BISR): the coefficients and the multi-participation sensitivity, nothing else.

Kalinin, McKenna, Upadhyay, Lampert, "Back to square roots" (ICLR 2026, arXiv 2505.12128). The noise of step t is the
finite filter w_t = Σ_{j<b} d_j z_{t−j} of independent draws z: C⁻¹ is lower-triangular Toeplitz with b bands, d its
first column, and training releases C⁻¹(C x + z), a post-processing of the Gaussian mechanism C x + z (x the clipped
sums; Denisov et al. 2022, arXiv 2202.08312, Thm 2.1: adaptively chosen x have the same guarantee for lower-triangular
C). d are BISR's: the first b coefficients of (1 − x)^{1/2}, the inverse square root of the prefix-sum matrix A
truncated to b bands (d_0 = 1, d_j = d_{j−1}·(j − 3/2)/j: 1, −1/2, −1/8, −1/16, …). They depend on b only, so anyone
recomputes C and the sensitivity from (b, n). We take BISR's closed form rather than optimise d numerically: it is
the paper's, needs no cache, and keeps the accounting a function of public (b, n).

Sensitivity (in units of the clip norm): an example that takes part in steps π moves C x by Σ_{i∈π} C_{:,i} g_iᵀ with
‖g_i‖ ≤ 1, whose norm is at most √(Σ_{i,j∈π} |(CᵀC)_{ij}|), with equality when CᵀC ≥ 0 elementwise and all g_i
equal. C = (Toeplitz d)⁻¹ has coefficients c ≥ 0 (1/(1 − Σ_{j≥1}|d_j| x^j) has non-negative coefficients), checked
here, so the bound is exact, ‖C 1_π‖, and grows with π. Our sampler puts each example in one of b partitions and
partition p can only be sampled at steps p, p + b, p + 2b, …, so the sensitivity of n steps is
max_p ‖C 1_{p + bℕ}‖: no amplification by sampling is claimed (none is proven for this schema that we could read).
`sensitivity` computes that in O(n·b²); the tests compare it with a brute force over every pattern with separation
≥ b (the b-min-sep schema), which it also equals for these c (non-negative and non-increasing; BSR paper, arXiv
2405.13763, Thm 2; jax_privacy's `compute_banded_inverse_sensitivity_squared` states the same for this case).
"""

from __future__ import annotations

import functools

import numpy as np
from scipy import signal


def bisr_coefficients(bands: int) -> np.ndarray:
    """d_0 … d_{b−1}: the first b coefficients of (1 − x)^{1/2}, the banded inverse square root's first column."""
    d = np.ones(int(bands))
    for j in range(1, int(bands)):
        d[j] = d[j - 1] * (j - 1.5) / j
    return d


def strategy_coefficients(bands: int, n: int) -> np.ndarray:
    """c_0 … c_{n−1}: the first column of C = (Toeplitz d)⁻¹ for n steps (dense lower-triangular Toeplitz)."""
    impulse = np.zeros(int(n))
    impulse[0] = 1.0
    return signal.lfilter([1.0], bisr_coefficients(bands), impulse)


def step_noise_factor(bands: int) -> float:
    """‖d‖: the std of the noise a step adds once b draws have run, in units of σ·C (b = 1: DP-SGD's 1)."""
    return float(np.linalg.norm(bisr_coefficients(bands)))


@functools.lru_cache(maxsize=256)
def sensitivity(bands: int, steps: int) -> float:
    """max over partitions p of ‖C 1_π‖, π = {p, p + b, …} ∩ [0, steps): the L2 sensitivity of the `steps` releases
    C x in units of the clip norm, under b-partition participation, no amplification (module docstring)."""
    b, n = int(bands), int(steps)
    if b < 1 or n < 0:
        raise ValueError(f"bands must be >= 1 and steps >= 0, got bands={bands}, steps={steps}.")
    if n == 0:
        return 0.0
    d = bisr_coefficients(b)
    if np.any(strategy_coefficients(b, n) < 0):  # the exact form above needs CᵀC ≥ 0
        raise ValueError(f"The banded-inverse strategy for b={b} has negative coefficients: no exact sensitivity.")
    worst = 0.0
    for p in range(min(b, n)):
        pattern = np.zeros(n)
        pattern[p::b] = 1.0
        worst = max(worst, float(np.linalg.norm(signal.lfilter([1.0], d, pattern))))
    return worst
