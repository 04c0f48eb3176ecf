"""Adaptive clipping: C follows a private estimate of a quantile of the per-unit gradient norms.

Andrew, Thakkar, McMahan, Ramaswamy, *Differentially Private Learning with Adaptive Clipping*, NeurIPS 2021 (arXiv
1905.03871), Algorithm 1 with its geometric update, in DP-SGD's setting (a unit is an example, or a user at user
level). Every step, besides the clipped sum, the run releases how many sampled units were not clipped:

* b_i = 1 when unit i's flat gradient norm is ≤ C (the C the step clipped at), else 0 (also for a non-finite norm,
  whose gradient the clip zeroes);
* released: s̃ = Σ_i (b_i − ½) + N(0, σ_b²), noised once over all processes, from its own secret stream;
* b̃ = s̃ / m + ½, the noisy unclipped fraction (m: the expected logical batch q·N, public);
* C ← C · exp(−η (b̃ − γ)), γ = `target_quantile`, η = `clip_learning_rate` (the paper's 0.2).

Why the centred bits b_i − ½ (the paper's own device in its privacy analysis): adding or removing one unit moves
Σ(b_i − ½) by exactly ½, whatever b_i is. Under Poisson sampling the batch size is private, so the plain count Σ b_i
(sensitivity 1) would need twice the noise for the same guarantee; Σ(b_i − ½) = Σ b_i − |batch|/2 never releases
the batch size, and E[b̃] is still the unclipped fraction, since E|batch| = m.

Privacy of the joint release (the paper's Theorem 1): the clipped sum has sensitivity C and noise z_Δ·C, the centred
count sensitivity ½ and noise σ_b, so the pair, each part divided by its noise std, is one Gaussian mechanism of
sensitivity √(z_Δ⁻² + (2σ_b)⁻²) at unit noise: a Gaussian mechanism with noise multiplier z,

    z⁻² = z_Δ⁻² + (2σ_b)⁻²,   hence   z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2).

The plan calibrates z for the target (ε, δ) exactly as for fixed clipping, the ledger records every step as one
Poisson-subsampled Gaussian release at z (with z_Δ, σ_b in the event), and the gradient noise is raised to z_Δ > z:
the count is paid for by that extra gradient noise, not by ε. It needs 2σ_b > z; the paper's σ_b = m/20 gives
z_Δ ≈ z·(1 + 50 z²/m²) for m ≫ z, e.g. +0.08% at z = 1, m = 256. C is not data-independent any more, but every C is a
function of released values only (post-processing), so the analysis stays that of DP-SGD with the effective z.

Here: the arithmetic, the config's checks and the card's wording; the count and the update during a run are
`hf_private.run.adaptive_clip`'s.
"""

from __future__ import annotations

import math
from typing import Any

ADAPTIVE = "adaptive"
#: How much Σ(b_i − ½) moves when one unit is added or removed.
COUNT_SENSITIVITY = 0.5
#: Methods whose training release is plain DP-SGD's on one trainable set, for which the joint analysis is checked.
SUPPORTED_METHODS = ("dp-sgd", "dp-lora")
_NOT_COVERED = {
    "dp-frost": "its selection rounds are noised to the fixed C and spend budget on it",
    "dp-fp": "its release is not DP-SGD's clipped gradient sum",
    "dp-bitfit": "its stage switch and its own recipe C are not covered by this analysis yet",
    "sparse-lowrank": "its masks and RGP re-decomposition are not covered by this analysis yet",
}


class AdaptiveClipError(ValueError):
    """Adaptive clipping cannot keep the accounted ε with these settings; the message says what to change."""


def gradient_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the gradient's noise multiplier that makes the clipped sum (noise z_Δ·C) and the
    centred unclipped count (noise σ_b, sensitivity ½) together one Gaussian release at noise multiplier z (Andrew et
    al. 2021, Theorem 1). Refused when 2σ_b ≤ z: the count alone would spend the whole budget."""
    z, sigma_b = float(noise_multiplier), float(count_noise_std)
    if not (math.isfinite(z) and z > 0):
        raise AdaptiveClipError(f"Adaptive clipping needs a finite noise multiplier z > 0, got {z}.")
    rest = z**-2 - (2.0 * sigma_b) ** -2 if sigma_b > 0 else -math.inf
    if not rest > 0:
        raise AdaptiveClipError(
            f"Adaptive clipping cannot keep noise multiplier z={z:.4g}: its count noise σ_b={sigma_b:.4g} must "
            f"exceed z/2={z / 2:.4g} (z⁻² = z_Δ⁻² + (2σ_b)⁻²), else the count alone spends the budget. Raise "
            "clip_count_noise (σ_b = clip_count_noise × expected batch), use a larger logical batch, or a smaller z "
            "(a larger target ε)."
        )
    return rest**-0.5


def effective_noise_multiplier(gradient_noise: float, count_noise_std: float) -> float:
    """z = (z_Δ⁻² + (2σ_b)⁻²)^(−1/2): the inverse of `gradient_noise_multiplier`."""
    return (gradient_noise**-2 + (2.0 * count_noise_std) ** -2) ** -0.5


def geometric_update(clip: float, unclipped_fraction: float, target_quantile: float, learning_rate: float) -> float:
    """C · exp(−η (b̃ − γ)): C shrinks while more than γ of the units go unclipped, grows while fewer do."""
    return clip * math.exp(-learning_rate * (unclipped_fraction - target_quantile))


def check_adaptive_settings(config: Any) -> None:
    """The DP config's adaptive-clipping fields: refuse, naming what to change, what the analysis does not cover."""
    adaptive = config.max_grad_norm == ADAPTIVE
    if isinstance(config.max_grad_norm, str) and not adaptive:
        raise ValueError(f"max_grad_norm is a clip norm C > 0 or {ADAPTIVE!r}, got {config.max_grad_norm!r}.")
    if not adaptive:
        if config.initial_max_grad_norm is not None:
            raise ValueError(
                f"initial_max_grad_norm is the starting C of max_grad_norm={ADAPTIVE!r}; with a fixed "
                f"max_grad_norm={config.max_grad_norm} leave it None."
            )
        return
    if config.method not in SUPPORTED_METHODS:
        why = _NOT_COVERED.get(config.method, "its releases are not covered by the adaptive clipping analysis")
        raise ValueError(
            f"max_grad_norm={ADAPTIVE!r} is not supported by method {config.method!r}: {why}. Use a fixed "
            f"max_grad_norm (measured with hf_private.median_gradient_norm), or DPConfig / DPLoRAConfig."
        )
    if config.privacy_unit == "user" and config.user_sampling == "example":
        raise ValueError(
            f"max_grad_norm={ADAPTIVE!r} is not supported with user_sampling='example' (ELS): a user with k sampled "
            "examples moves the unclipped count by up to k/2, not ½. Use user_sampling='user' (ULS), whose count "
            "is over users, or a fixed max_grad_norm."
        )
    start = config.initial_max_grad_norm
    if start is None or not (math.isfinite(start) and start > 0):
        raise ValueError(
            f"max_grad_norm={ADAPTIVE!r} needs initial_max_grad_norm, the starting C > 0 (got {start!r}): measure it "
            "on public inputs with hf_private.median_gradient_norm(model, DPConfig(noise_multiplier=1.0), "
            "calibration, collator), never on the private data."
        )
    if not 0 < config.target_quantile < 1:
        raise ValueError(f"target_quantile must be in (0, 1), got {config.target_quantile}.")
    if not (math.isfinite(config.clip_learning_rate) and config.clip_learning_rate > 0):
        raise ValueError(f"clip_learning_rate must be finite and > 0, got {config.clip_learning_rate}.")
    if not (math.isfinite(config.clip_count_noise) and config.clip_count_noise > 0):
        raise ValueError(f"clip_count_noise must be finite and > 0, got {config.clip_count_noise}.")


def initial_clip_norm(config: Any) -> float:
    """C at the start of a run: the fixed max_grad_norm, or initial_max_grad_norm under adaptive clipping."""
    return float(config.initial_max_grad_norm if config.max_grad_norm == ADAPTIVE else config.max_grad_norm)


def describe_clip(config: Any) -> str:
    """The clip norm as the plan line says it."""
    if config.max_grad_norm != ADAPTIVE:
        return f"C={float(config.max_grad_norm):.4g}"
    return (
        f"C adaptive (from {initial_clip_norm(config):.4g} towards the {config.target_quantile:g} quantile of the "
        f"per-unit gradient norms, Andrew et al. 2021)"
    )


def clip_line(facts: dict[str, Any]) -> str:
    """The card's one line on adaptive clipping, from `AdaptiveClip.report()`."""
    return (
        f"adaptive (Andrew et al. 2021): from {facts['initial_max_grad_norm']:.4g} to "
        f"{facts['final_max_grad_norm']:.4g} over {facts['updates']} steps (range {facts['lowest_max_grad_norm']:.4g}"
        f"–{facts['highest_max_grad_norm']:.4g}), towards the {facts['target_quantile']:g} quantile of the per-unit "
        f"gradient norms; each step the noisy unclipped count (noise std {facts['count_noise_std']:.4g}) was released "
        f"with the clipped sum (noise multiplier {facts['gradient_noise_multiplier']:.4g}), together one Gaussian "
        f"release at noise multiplier {facts['noise_multiplier']:.4g}, the σ in the mechanisms table"
    )
