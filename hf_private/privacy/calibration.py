"""Solving the accountant backwards: the noise for a target ε, and the steps a budget still allows.

RDP evaluations are cheap (~20 ms), PRV ones are not (0.1-0.3 s at a thousand steps, more at small σ
where PRV's grid grows). So a search under an accountant with a `search_seed` (PRV's is RDP) starts from the
answer of the same search under the seed (looser, so the answers are close) and takes safeguarded secant steps: a
handful of PRV evaluations instead of fifteen to twenty. An accountant without a seed is searched by itself (RDP:
bisection). Every answer is checked by the requested accountant itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..logs import get_logger
from .accountants import accountant_named, check_accountant, compute_epsilon
from .events import MechanismGroup, gaussian_event

logger = get_logger(__name__)

# A search that has not converged by then returns its best *feasible* point, which is still safe.
_MAX_EVALUATIONS = 60
_SAME_SIDE_BEFORE_BISECTING = 2


class BudgetError(ValueError):
    """The privacy target cannot be met with the requested plan."""


def _validate(target_epsilon: float, delta: float, sample_rate: float, accountant: str) -> None:
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}.")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
    check_accountant(accountant)


def _check_prior(prior_epsilon: float, target_epsilon: float) -> None:
    if prior_epsilon > target_epsilon:
        raise BudgetError(
            f"The mechanisms already recorded spend ε={prior_epsilon:.4g}, more than the target "
            f"ε={target_epsilon:.4g}, so nothing more can be released: raise target_epsilon, or start "
            "from a ledger with fewer recorded steps."
        )


def _seed_of(accountant: str) -> str:
    """The accountant whose search seeds one under `accountant`: its `search_seed`, or itself."""
    return accountant_named(accountant).search_seed or accountant


def _hint(accountant: str) -> str:
    hint = accountant_named(accountant).budget_hint
    return f" {hint}" if hint else ""


def _too_little_noise(
    max_sigma: float, eps: float, target: float, steps: int, sample_rate: float, accountant: str
) -> BudgetError:
    hint = _hint(accountant)
    return BudgetError(
        f"Even σ={max_sigma:g} gives ε={eps:.4g} > target ε={target:.4g} for {steps} steps at sample rate "
        f"{sample_rate:.4g}: train fewer steps/epochs, use a smaller sample rate (batch size), or allow a "
        f"larger ε.{hint}"
    )


def _too_little_noise_jointly(stages: str, eps: float, target: float, accountant: str) -> BudgetError:
    hint = _hint(accountant)
    return BudgetError(
        f"Even the most noise allowed ({stages}) gives ε={eps:.4g} > target ε={target:.4g}: train fewer "
        f"steps/epochs, use smaller sample rates (batch sizes), or allow a larger ε.{hint}"
    )


def _epsilon_of(
    delta: float,
    accountant: str,
    prior: Sequence[MechanismGroup],
    name: str,
    examples_per_user: int | None = None,
    bands: int | None = None,
    banded_inverse: bool = False,
) -> Callable[[float, float, int], float]:
    prior = list(prior)

    def epsilon(noise_multiplier: float, sample_rate: float, steps: int) -> float:
        event = gaussian_event(
            name,
            noise_multiplier,
            sample_rate,
            steps,
            examples_per_user=examples_per_user,
            bands=bands,
            banded_inverse=banded_inverse,
        )
        return compute_epsilon([*prior, event], delta, accountant)

    return epsilon


def _bisect_sigma(
    epsilon: Callable[[float], float], target: float, tolerance: float, max_sigma: float
) -> tuple[float, float]:
    """Appendix A / opacus `get_noise_multiplier`: returns (σ_high, slope of log ε in log σ near it)."""
    sigma_low, eps_low = 0.0, math.inf
    sigma_high, eps_high = min(10.0, max_sigma / 2), math.inf  # the first evaluation is at 2·10
    while eps_high > target:
        if sigma_high >= max_sigma:
            raise BudgetError
        sigma_high = min(2 * sigma_high, max_sigma)
        eps_high = epsilon(sigma_high)
    while target - eps_high > tolerance and sigma_high - sigma_low > 1e-9 * sigma_high:
        sigma = (sigma_low + sigma_high) / 2
        eps = epsilon(sigma)
        if eps < target:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low, eps_low = sigma, eps
    slope = _slope(sigma_low, eps_low, sigma_high, eps_high)
    return sigma_high, -1.0 if slope is None else slope


def _slope(sigma_a: float, eps_a: float, sigma_b: float, eps_b: float) -> float | None:
    """d log ε / d log σ between two points, when it is defined and negative."""
    if min(sigma_a, sigma_b, eps_a, eps_b) <= 0 or math.isinf(max(eps_a, eps_b)) or sigma_a == sigma_b:
        return None
    slope = math.log(eps_a / eps_b) / math.log(sigma_a / sigma_b)
    return slope if slope < 0 else None


def _secant_sigma(
    epsilon: Callable[[float], float],
    target: float,
    tolerance: float,
    sigma: float,
    slope: float,
    max_sigma: float,
) -> float:
    """σ with target − tolerance ≤ ε(σ) ≤ target, by secant steps in (log σ, log ε) from `sigma`.

    Steps aim at the middle of the band; they move by at most a factor 2 until the root is bracketed,
    then stay inside the bracket, and fall back to bisection when they keep landing on one side.
    """
    log_aim = math.log(target - tolerance / 2)
    low, high = 0.0, math.inf  # ε(low) > target ≥ ε(high)
    previous: tuple[float, float] | None = None
    side, same_side = 0, 0
    for _ in range(_MAX_EVALUATIONS):
        eps = epsilon(sigma)
        if eps <= target:
            if target - eps <= tolerance:
                return sigma
            high, this_side = sigma, 1
        else:
            if sigma >= max_sigma:
                raise BudgetError
            low, this_side = sigma, -1
        same_side = same_side + 1 if this_side == side else 1
        side = this_side
        if previous is not None:
            slope = _slope(sigma, eps, *previous) or slope
        previous = (sigma, eps)
        guess = math.exp(math.log(sigma) + (log_aim - math.log(eps)) / slope) if math.isfinite(eps) else math.inf
        if low > 0 and math.isfinite(high):
            if not low < guess < high or same_side > _SAME_SIDE_BEFORE_BISECTING:
                guess = math.sqrt(low * high)
        else:
            guess = min(max(guess, sigma / 2), 2 * sigma, max_sigma)
        sigma = guess
    if math.isinf(high):
        raise BudgetError
    logger.warning(
        "Noise calibration stopped after %d evaluations short of the tolerance; σ=%.6g is feasible.",
        _MAX_EVALUATIONS,
        high,
    )
    return high


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    prior: Sequence[MechanismGroup] = (),
    name: str = "dp-sgd",
    tolerance: float = 0.01,
    max_noise_multiplier: float = 1000.0,
    examples_per_user: int | None = None,
    bands: int | None = None,
    banded_inverse: bool = False,
) -> float:
    """The σ such that `prior` + `steps` releases of (σ, `sample_rate`) spend ε ≤ `target_epsilon`.

    The returned σ satisfies target − tolerance ≤ ε(σ) ≤ target under `accountant`: the budget is never
    exceeded. Under RDP this is the bisection of opacus' `get_noise_multiplier` and DP-FROST's Algorithm
    2 (σ_high from 10 doubled until feasible, σ_low = 0, halve while target − ε(σ_high) > tolerance,
    return σ_high); under PRV the RDP answer seeds secant steps checked by PRV. It is `calibrate_jointly`
    with one mechanism of noise ratio 1.

    With `examples_per_user` = k the releases are user-level ELS ones (`MechanismGroup.els`: per-example rate q,
    at most k examples per user): the search is the same, on their ε (under "prv" the PLD accountant checks it,
    seeded by the RDP answer for `accountants.rdp.els_fallback`). With `bands` = b they are amplified BandMF steps
    (`events.BAND_MF`: ⌈steps/b⌉ releases at the per-partition rate `sample_rate`), with `banded_inverse` too
    banded-inverse steps (`events.BAND_INV_MF`: one Gaussian at σ / sensitivity).
    """
    _validate(target_epsilon, delta, sample_rate, accountant)
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}.")
    mechanism = JointMechanism(name, 1.0, sample_rate, int(steps), examples_per_user, bands, banded_inverse)
    return calibrate_jointly(
        target_epsilon,
        delta,
        [mechanism],
        accountant=accountant,
        prior=prior,
        tolerance=tolerance,
        max_noise_multiplier=max_noise_multiplier,
    )


@dataclass(frozen=True)
class JointMechanism:
    """One mechanism of a joint calibration: `steps` releases of (σ = `noise_ratio` · s, `sample_rate`), user-level
    ELS ones with at most `examples_per_user` examples per user when that is given, BandMF steps with `bands`."""

    name: str
    noise_ratio: float
    sample_rate: float
    steps: int
    examples_per_user: int | None = None
    bands: int | None = None
    banded_inverse: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_ratio) and self.noise_ratio > 0):
            raise ValueError(f"noise_ratio of {self.name!r} must be finite and > 0, got {self.noise_ratio}.")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate of {self.name!r} must be in (0, 1], got {self.sample_rate}.")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps of {self.name!r} must be a non-negative integer, got {self.steps}.")
        if self.examples_per_user is not None:
            gaussian_event(self.name, 1.0, self.sample_rate, 0, examples_per_user=self.examples_per_user)  # checks k

    def event(self, scale: float) -> MechanismGroup:
        """The ledger event of this mechanism's releases at σ = noise_ratio · `scale`."""
        return gaussian_event(
            self.name,
            self.noise_ratio * scale,
            self.sample_rate,
            self.steps,
            examples_per_user=self.examples_per_user,
            bands=self.bands,
            banded_inverse=self.banded_inverse,
        )


def calibrate_jointly(
    target_epsilon: float,
    delta: float,
    mechanisms: Sequence[JointMechanism],
    accountant: str = "prv",
    prior: Sequence[MechanismGroup] = (),
    tolerance: float = 0.01,
    max_noise_multiplier: float = 1000.0,
) -> float:
    """The scale s such that `prior` + every mechanism i at σ_i = ratio_i · s spends ε ≤ `target_epsilon`.

    One scalar for all: ε of the composition is non-increasing in s, so the one-mechanism search applies
    unchanged (RDP bisection, then PRV secant steps from its answer), and target − tolerance ≤ ε(s) ≤ target
    under `accountant`. The largest σ_i is at most `max_noise_multiplier`. With one mechanism of ratio 1, s is
    exactly `calibrate_noise_multiplier`'s σ (the same evaluations in the same order).
    """
    mechanisms = list(mechanisms)
    active = [m for m in mechanisms if m.steps > 0]
    if not active:
        raise ValueError("A joint calibration needs at least one mechanism with steps >= 1.")
    for mechanism in mechanisms:
        _validate(target_epsilon, delta, mechanism.sample_rate, accountant)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}.")
    tolerance = min(tolerance, target_epsilon / 10)  # a tiny target still gets a relative precision
    if not max_noise_multiplier > 0:
        raise ValueError(f"max_noise_multiplier must be > 0, got {max_noise_multiplier}.")
    max_scale = max_noise_multiplier / max(m.noise_ratio for m in active)
    if prior:
        _check_prior(compute_epsilon(prior, delta, accountant), target_epsilon)
    prior = list(prior)

    def under(accountant: str) -> Callable[[float], float]:
        def epsilon(scale: float) -> float:
            events = [m.event(scale) for m in active]
            return compute_epsilon([*prior, *events], delta, accountant)

        return epsilon

    def too_little_noise() -> BudgetError:
        eps = under(accountant)(max_scale)
        if len(active) == 1:
            (only,) = active
            return _too_little_noise(
                only.noise_ratio * max_scale, eps, target_epsilon, only.steps, only.sample_rate, accountant
            )
        stages = ", ".join(
            f"{m.name}: σ={m.noise_ratio * max_scale:g}, q={m.sample_rate:.4g}, {m.steps} steps" for m in active
        )
        return _too_little_noise_jointly(stages, eps, target_epsilon, accountant)

    seed = _seed_of(accountant)
    try:
        scale, slope = _bisect_sigma(under(seed), target_epsilon, tolerance, max_scale)
    except BudgetError:
        if seed == accountant:
            raise too_little_noise() from None
        scale, slope = max_scale, -1.0  # the seed is looser: the accountant may still meet the target
    if seed == accountant:
        return scale
    try:
        return _secant_sigma(under(accountant), target_epsilon, tolerance, scale, slope, max_scale)
    except BudgetError:
        raise too_little_noise() from None


def _largest_k(epsilon: Callable[[int], float], target: float, eps_zero: float, start: int, upper: int) -> int:
    """The largest k in [0, upper] with ε(k) ≤ target, for ε non-decreasing in k and ε(0) = eps_zero ≤ target.

    Secant steps on ε², which grows about linearly in k, from `start`: at most a factor 8 per step
    until the boundary is bracketed, then inside the bracket; bisection when steps keep landing on one
    side.
    """
    low, high = 0, upper + 1  # ε(low) ≤ target < ε(high); upper + 1 stands for "not found yet"
    previous = (0, eps_zero)
    k = min(max(start, 1), upper)
    side, same_side = 0, 0
    while high - low > 1:
        eps = epsilon(k)
        if eps <= target:
            low, this_side = k, 1
        else:
            high, this_side = k, -1
        same_side = same_side + 1 if this_side == side else 1
        side = this_side
        rate = (eps**2 - previous[1] ** 2) / (k - previous[0]) if math.isfinite(eps) else math.nan
        previous = (k, eps)
        guess = math.floor(k + (target**2 - eps**2) / rate) if rate > 0 else None
        if high > upper:
            guess = min(max(2 * low if guess is None else guess, low + 1), 8 * low, upper)
        elif guess is None or same_side > _SAME_SIDE_BEFORE_BISECTING:
            guess = (low + high) // 2
        else:
            guess = min(max(guess, low + 1), high - 1)
        k = guess
    return low


def max_steps_within(
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sample_rate: float,
    accountant: str = "prv",
    prior: Sequence[MechanismGroup] = (),
    name: str = "dp-sgd",
    upper: int = 10**7,
    examples_per_user: int | None = None,
    bands: int | None = None,
    banded_inverse: bool = False,
) -> int:
    """The largest k ≥ 0 (at most `upper`) with ε(`prior` + k releases of (σ, q)) ≤ `target_epsilon`.

    Used to stop training before the budget is exceeded. ε is non-decreasing in k; under PRV the search
    starts from the RDP answer (PRV is tighter, so it allows at least about as many steps). With
    `examples_per_user` the releases are user-level ELS ones, with `bands` BandMF steps (as in
    `calibrate_noise_multiplier`).
    """
    _validate(target_epsilon, delta, sample_rate, accountant)
    if int(upper) != upper or upper < 0:
        raise ValueError(f"upper must be a non-negative integer, got {upper}.")
    prior_epsilon = compute_epsilon(prior, delta, accountant)
    _check_prior(prior_epsilon, target_epsilon)
    if noise_multiplier == 0 or upper == 0:
        return 0

    def under(accountant: str) -> Callable[[int], float]:
        epsilon = _epsilon_of(delta, accountant, prior, name, examples_per_user, bands, banded_inverse)
        return lambda k: epsilon(noise_multiplier, sample_rate, k)

    seed = _seed_of(accountant)
    seed_prior = prior_epsilon if seed == accountant else compute_epsilon(prior, delta, seed)
    start = 1
    if seed_prior <= target_epsilon:
        start = _largest_k(under(seed), target_epsilon, seed_prior, 1, upper)
    if seed == accountant:
        return start
    return _largest_k(under(accountant), target_epsilon, prior_epsilon, start, upper)
