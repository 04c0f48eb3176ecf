"""Amplified banded matrix factorization (BandMF): correlated noise whose privacy is DP-SGD's at b times the rate.

Choquette-Choo, McKenna, McMahan, Rush, Thakurta, "(Amplified) Banded Matrix Factorization: A unified approach to
private training", NeurIPS 2023, arXiv 2306.08153. Training releases x_t + (C⁻¹z)_t instead of x_t + z_t, where C is
an n×n lower-triangular strategy with b nonzero diagonals and z_t ~ N(0, σ²C_clip²) is the noise DP-SGD would add.
The data are split into b partitions and step t Poisson-samples partition t mod b at q̂ = b·B/N (`sampling`), so an
example takes part in steps at least b apart: its contributions to C·x never overlap, and the amplification theorem
(Theorem 4 of the paper; also jax_privacy's `amplified_bandmf_event`) makes the run exactly as private as DP-SGD with
rate q̂, noise multiplier σ / max column norm of C (= σ here: columns are normalised to norm ≤ 1) and ⌈n/b⌉ rounds.

The strategy is Toeplitz (c_0 … c_{b−1} on its diagonals, the variant McKenna 2024, arXiv 2405.15913, scales to 10⁴
steps), chosen to minimise the expected total squared error of the prefix sums, ‖A C⁻¹‖_F² with A the lower-triangular
ones, under ‖c‖ = 1. C⁻¹ is lower-triangular Toeplitz too: its coefficients d are the impulse response of 1/c(z)
(a banded forward substitution, `scipy.signal.lfilter`), A C⁻¹'s are the prefix sums e of d, and
‖A C⁻¹‖_F² = Σ_k (n − k)·e_k², evaluated in O(n·b) with its exact gradient (∂d/∂c_j = −(d ∗ d) shifted by j), so
L-BFGS needs no autograd. b = 1 gives c = [1]: C = I, DP-SGD itself. Strategies depend on (n, b) only (public), and
are cached on disk. Measured for n = 10⁴ steps on a shared 2-core CPU (load ~6): 0.50 s for b = 4, 0.43 s for b = 16,
0.75 s for b = 64 (‖A C⁻¹‖_F² 1.26e7, 3.31e6 and 9.71e5 against DP-SGD's 5.0e7).

The noise of step t is applied in the streaming form of C w = z: w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, so only
the last b − 1 noise vectors are kept (`BandedNoise`). They are as secret as the noise itself: they live in the
checkpoint's own file (`release.artifacts.BAND_MF_STATE_NAME`), never pushed; `run.band_mf` wires all of this into a
run (`DPConfig(noise_mechanism="band-mf", bands=b)`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import optimize, signal

from ..logs import get_logger
from . import band_inv_mf
from .band_inv_mf import BAND_INV_MF_MECHANISM
from .events import BAND_INV_MF, BAND_MF, MechanismGroup

logger = get_logger(__name__)

_CACHE_VERSION = 1

DP_SGD, BAND_MF_MECHANISM = "dp-sgd", "band-mf"
NOISE_MECHANISMS = (DP_SGD, BAND_MF_MECHANISM, BAND_INV_MF_MECHANISM)
AUTO_BANDS = "auto"  # bands="auto": `band_auto.choose_bands` picks b
#: the methods whose one training release is DP-SGD's clipped sum over one trainable set, which BandMF replaces
SUPPORTED_METHODS = ("dp-sgd", "dp-lora")
_NOT_COVERED = {
    "dp-frost": "its selection rounds are releases of their own, outside the b-min-sep schedule",
    "dp-fp": "its release is not DP-SGD's clipped gradient sum",
    "dp-bitfit": "its stage switch changes the trainable set, so the noise history no longer fits it",
    "sparse-lowrank": "its masks and RGP re-decomposition change the released coordinates between steps",
}


def check_band_mf_settings(config: Any) -> None:
    """The DP config's noise_mechanism and bands: refuse, by name, what the BandMF (or banded-inverse) analysis does
    not cover."""
    mechanism = config.noise_mechanism
    if mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {', '.join(map(repr, NOISE_MECHANISMS))}, got {mechanism!r}.")
    if config.bands == AUTO_BANDS:
        if mechanism == DP_SGD or config.target_epsilon is None:
            raise ValueError(
                f"bands='auto' picks b for noise_mechanism={BAND_MF_MECHANISM!r} or 'band-inv-mf' by the error at a "
                "target ε: set one of them and target_epsilon, or give bands as an integer."
            )
    else:
        check_bands(config.bands)
    if mechanism == DP_SGD:
        if config.bands != 1:
            raise ValueError(
                f"bands={config.bands!r} is the number of bands of noise_mechanism={BAND_MF_MECHANISM!r}; "
                f"DP-SGD has none: set noise_mechanism={BAND_MF_MECHANISM!r}, or leave bands=1."
            )
        return
    if config.method not in SUPPORTED_METHODS:
        why = _NOT_COVERED.get(config.method, "its releases are not covered by the BandMF analysis")
        raise ValueError(
            f"noise_mechanism={mechanism!r} is not supported by method {config.method!r}: {why}. Use "
            "DPConfig or DPLoRAConfig, or noise_mechanism='dp-sgd'."
        )
    if config.privacy_unit != "example":
        raise ValueError(
            f"noise_mechanism={mechanism!r} is not supported with privacy_unit={config.privacy_unit!r}: "
            "its analysis (b-min-sep sampling of partitions) is for one example per unit. Use "
            "privacy_unit='example' or noise_mechanism='dp-sgd'."
        )
    if config.max_grad_norm == "adaptive":
        raise ValueError(
            f"noise_mechanism={mechanism!r} is not supported with max_grad_norm='adaptive': the joint "
            "release of the clipped sum and the unclipped count is analysed for independent noise only. Use a "
            "fixed max_grad_norm, or noise_mechanism='dp-sgd'."
        )


def check_band_mf_run(bands: int, steps: int | None, expected_batch_size: int, dataset_size: int) -> float:
    """q̂ = b·B/N for a run of `steps` steps: refused when b exceeds the steps or the partitions hold fewer than B."""
    check_bands(bands, steps)
    rate = bands * expected_batch_size / dataset_size
    if rate > 1:
        raise ValueError(
            f"bands={bands} with an expected batch of {expected_batch_size} needs b·B ≤ N={dataset_size} (each "
            f"partition of about N/b examples is sampled at q̂ = b·B/N = {rate:.3g} > 1): use fewer bands or a "
            "smaller batch."
        )
    return rate


def check_bands(bands: int, steps: int | None = None) -> int:
    """b: a positive integer (at most the run's steps, when known)."""
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"bands must be a positive integer (1 is DP-SGD), got {bands!r}.")
    if steps is not None and bands > steps:
        raise ValueError(f"bands={bands} exceeds the run's {steps} steps: use at most {steps}.")
    return bands


def rounds(steps: int, bands: int) -> int:
    """⌈steps / b⌉: how many of `steps` BandMF steps one example can take part in (b-min-sep participation)."""
    return -(-int(steps) // int(bands))


def band_mf_event(
    name: str,
    noise_multiplier: float,
    sample_rate: float,
    bands: int,
    steps: int = 1,
    max_grad_norm: float | None = None,
) -> MechanismGroup:
    """`steps` BandMF training steps at noise multiplier σ (strategy column norm ≤ 1) and per-partition rate q̂: the
    ledger's typed event, accounted as ⌈steps/b⌉ Poisson-subsampled Gaussian releases (q̂, σ) (`events.releases_of`)."""
    return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm, BAND_MF, bands=check_bands(bands))


def card_release(entry: dict[str, Any]) -> dict[str, Any]:
    """A ledger entry as the card's `privacy.mechanisms` lists it: a BandMF event as what it is accounted as,
    ⌈n/b⌉ Poisson-subsampled Gaussian releases at (q̂, σ) (`steps`; its n training steps in `training_steps`), so a
    standard accountant recomputes ε from the entry alone; a banded-inverse one as `band_inv_mf.card_release` lists
    it; any other entry as it is."""
    if entry.get("mechanism") == BAND_INV_MF:
        return band_inv_mf.card_release(entry)
    if entry.get("mechanism") != BAND_MF:
        return dict(entry)
    return {
        **entry,
        "steps": rounds(entry["steps"], entry["bands"]),
        "training_steps": int(entry["steps"]),
        "accounted_as": "poisson_gaussian",
    }


def card_line(facts: dict[str, Any]) -> str:
    """The card's one line on the noise, from `run.band_mf.BandMF.report()`."""
    if facts["mechanism"] == BAND_INV_MF_MECHANISM:
        return band_inv_mf.card_line(facts)
    return (
        f"amplified BandMF (Choquette-Choo et al. 2023): correlated noise over {facts['bands']} bands (optimised "
        f"Toeplitz strategy, columns of norm ≤ 1), the data split into {facts['bands']} secret partitions, step t "
        f"Poisson-sampling partition t mod {facts['bands']} at q̂ = {facts['sample_rate']:.4g}; accounted as "
        "⌈steps/bands⌉ Poisson-subsampled Gaussian releases at q̂ (the mechanisms table)"
    )


# ---------------------------------------------------------------------------------------------- the strategy
def inverse_coefficients(c: np.ndarray, n: int) -> np.ndarray:
    """d_0 … d_{n−1}, the first column of C⁻¹ for the Toeplitz banded C with first column `c` (forward substitution)."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return signal.lfilter([1.0], np.asarray(c, dtype=np.float64), impulse)


def filter_prefix_loss(d: Sequence[float] | np.ndarray, n: int) -> float:
    """‖A D‖_F² for the prefix-sum workload A (lower-triangular ones) and the lower-triangular Toeplitz noise filter D
    with first column `d` (cut or zero-padded to n): the expected total squared error of n released prefix sums per
    unit of σ²."""
    kept = np.asarray(d, dtype=np.float64)[: int(n)]
    first_column = np.zeros(int(n))
    first_column[: len(kept)] = kept
    e = np.cumsum(first_column)
    return float(np.dot(np.arange(n, 0, -1, dtype=np.float64), e * e))


def prefix_loss(c: Sequence[float] | np.ndarray, n: int) -> float:
    """‖A C⁻¹‖_F²: `filter_prefix_loss` of BandMF's noise filter C⁻¹, at unit sensitivity (‖c‖ = 1). The identity
    (DP-SGD) gives n(n+1)/2."""
    return filter_prefix_loss(inverse_coefficients(np.asarray(c, dtype=np.float64), n), n)


def _normalised_loss_and_grad(theta: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """f(θ) = ‖θ‖²·‖A Θ⁻¹‖_F²: the loss of c = θ/‖θ‖ (scale-free), and its gradient in θ."""
    b = len(theta)
    d = inverse_coefficients(theta, n)
    e = np.cumsum(d)
    weights = np.arange(n, 0, -1, dtype=np.float64)
    loss = float(np.dot(weights, e * e))
    if not math.isfinite(loss):
        return math.inf, np.zeros(b)
    g = np.cumsum((2.0 * weights * e)[::-1])[::-1]  # ∂loss/∂d_i = Σ_{k ≥ i} 2 w_k e_k
    dd = signal.fftconvolve(d, d)[:n]  # ∂d_i/∂c_j = −(d ∗ d)_{i−j}
    grad = np.array([-np.dot(g[j:], dd[: n - j]) for j in range(b)])
    norm2 = float(np.dot(theta, theta))
    return norm2 * loss, 2.0 * theta * loss + norm2 * grad


def optimise_strategy(n: int, bands: int, *, max_iterations: int = 500) -> np.ndarray:
    """c_0 … c_{b−1}, ‖c‖ = 1, c_0 > 0, minimising ‖A C⁻¹‖_F² over b-banded Toeplitz C (L-BFGS from the identity)."""
    check_bands(bands, n)
    if bands == 1:
        return np.ones(1)
    start = np.zeros(bands)
    start[0] = 1.0
    result = optimize.minimize(
        _normalised_loss_and_grad,
        start,
        args=(n,),
        jac=True,
        method="L-BFGS-B",
        bounds=[(1e-6, None)] + [(None, None)] * (bands - 1),
        options={"maxiter": max_iterations},
    )
    c = result.x / np.linalg.norm(result.x)
    if not prefix_loss(c, n) <= prefix_loss(start, n):  # never worse than DP-SGD's strategy
        return start
    return c


def _cache_dir() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hf_private" / "band_mf"


def strategy(n: int, bands: int, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The optimised strategy for (n, b), from the disk cache when there (it depends on n and b only: public)."""
    check_bands(bands, n)
    if bands == 1:
        return np.ones(1)
    path = Path(cache_dir) if cache_dir is not None else _cache_dir()
    file = path / f"toeplitz_n{n}_b{bands}_v{_CACHE_VERSION}.json"
    if file.exists():
        try:
            c = np.array(json.loads(file.read_text())["coefficients"], dtype=np.float64)
            if len(c) == bands and abs(np.linalg.norm(c) - 1) < 1e-9 and c[0] > 0:
                return c
        except (ValueError, KeyError, TypeError):
            pass
        logger.warning("Ignoring an unreadable BandMF strategy cache entry %s.", file)
    started = time.perf_counter()
    c = optimise_strategy(n, bands)
    seconds = time.perf_counter() - started
    logger.info("BandMF strategy for n=%d, b=%d optimised in %.2f s.", n, bands, seconds)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"n": n, "bands": bands, "coefficients": c.tolist(), "seconds": seconds}))
        tmp.replace(file)
    except OSError as error:  # a read-only cache costs time, not correctness
        logger.warning("Could not cache the BandMF strategy in %s: %s", path, error)
    return c


def step_noise_factor(c: Sequence[float] | np.ndarray, n: int) -> float:
    """‖row n of C⁻¹‖: the std of the noise step n adds, in units of σ·C (DP-SGD: 1). It is the per-step noise an
    optimizer that divides by the gradient's running RMS (Adam) sees, where plain SGD sees only the prefix sums."""
    return float(np.linalg.norm(inverse_coefficients(np.asarray(c, dtype=np.float64), int(n))))


def strategy_matrix(c: Sequence[float], n: int) -> torch.Tensor:
    """The n×n lower-triangular banded Toeplitz C with first column `c` (float64; for tests and small n)."""
    matrix = torch.zeros(n, n, dtype=torch.float64)
    for j, value in enumerate(c):
        matrix += torch.diag(torch.full((n - j,), float(value), dtype=torch.float64), -j)
    return matrix


# ---------------------------------------------------------------------------------------------- the noise
class BandedNoise:
    """The streaming solve of C w = z: `correlate_` turns step t's fresh noise z_t (drawn by the secret sampler into
    zeroed buffers, exactly as DP-SGD draws it) into w_t in place, keeping the last b − 1 noise vectors (fp32, the
    trainable size each). The caller adds w_t to the clipped sums; the noise never mixes with data before it is final.
    """

    def __init__(self, coefficients: Sequence[float]) -> None:
        c = [float(x) for x in coefficients]
        if not c or not c[0] > 0:
            raise ValueError(f"BandMF coefficients need c_0 > 0, got {c[:1]}.")
        self.coefficients = c
        self.bands = len(c)
        self.step = 0
        self._history: deque[list[torch.Tensor]] = deque(maxlen=max(self.bands - 1, 0))

    def correlate_(self, noise: list[torch.Tensor]) -> None:
        """noise (z_t, one tensor per parameter) becomes w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, in place."""
        self.step += 1
        if self.bands == 1:
            return
        for j, past in enumerate(reversed(self._history), start=1):  # past = w_{t−j}
            for w, previous in zip(noise, past):
                w.sub_(previous.to(w.device).view_as(w), alpha=self.coefficients[j])
        for w in noise:
            w.div_(self.coefficients[0])
        self._history.append([w.detach().clone() for w in noise])

    def state_dict(self) -> dict[str, Any]:
        return {
            "bands": self.bands,
            "coefficients": list(self.coefficients),
            "step": self.step,
            "history": [[w.cpu() for w in step] for step in self._history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's sequence; refuse one made with another b or strategy (the noise would not cancel)."""
        if state["bands"] != self.bands:
            raise ValueError(
                f"The checkpoint's BandMF noise was made with bands={state['bands']}, this run has bands={self.bands}: "
                "resume with the bands it was started with (another b breaks its b-min-sep accounting)."
            )
        if not np.allclose(state["coefficients"], self.coefficients, rtol=0, atol=1e-12):
            raise ValueError("The checkpoint's BandMF strategy differs from this run's (another number of steps?).")
        self.step = int(state["step"])
        self._history.clear()
        for step in state["history"]:
            self._history.append([w.clone() for w in step])
