"""ε of a heterogeneous history of Poisson-subsampled Gaussian mechanisms, through opacus' accountants.

Why PRV is the default: the PRV accountant (Gopi et al. 2021) composes the privacy-loss distributions
numerically and returns a rigorous *upper* bound on ε (opacus' `PRVAccountant.get_epsilon` returns
`eps_upper`: the ε at δ − δ/1000 plus the discretisation error 0.01, never the point estimate). At
typical DP-SGD settings its ε is 10-20% below RDP's, which loses slack in the RDP → (ε, δ)
conversion; for the same target that is 5-10% less noise. RDP is the cheap, well-known alternative.
The Gaussian-DP central-limit approximation (opacus' "gdp") is not an upper bound and is never used
for the guarantee.

The noise is not exactly Gaussian: the sampler never draws beyond `rng.Z_MAX` std. `compute_epsilon` and
`epsilon_bound` take what that costs (`sampler_tail_delta`) out of δ first, so their ε at δ is the accountant's
at δ − δ_tail, for the releases as this library draws them.

User-level DP by example-level sampling (ELS, `ledger.ELS_POISSON_GAUSSIAN`, Charles et al. 2024): each user
has at most k examples, examples are Poisson-sampled at q, so one user moves the noised sum by J·C with
J ~ Binomial(k, q). Per release that is the mixture of Gaussians N(0, σ²) vs Σ_j Binom(k, q)[j]·N(j, σ²) (units
of C; Choquette-Choo et al. 2023, Cor. 4.7, reduce the vector case to this scalar one). How it is accounted:

* k = 1 is exactly the Poisson-subsampled Gaussian (σ, q): such an event is accounted as one, with everything
  above unchanged (same numbers as example-level DP-SGD).
* "prv" with any ELS event of k ≥ 2: opacus' PRV accountant has no mixture-of-Gaussians PRV, and its
  discretised PRVs cannot be composed with dp_accounting's privacy-loss distributions, so the *whole* history is
  composed with dp_accounting's PLD accountant (`MixtureOfGaussiansDpEvent` for the ELS events, the
  Poisson-subsampled Gaussian `PoissonSampledDpEvent(q, GaussianDpEvent(σ))` for the others; pessimistic
  connect-the-dots discretisation, both add and remove directions: an upper bound). The report names it "pld".
* "rdp" with any ELS event of k ≥ 2: dp_accounting's RDP accountant has no mixture-of-Gaussians event (0.6.0
  supports Gaussian, Poisson- and without-replacement-sampled Gaussian, tree aggregation, ...), so each ELS
  event is replaced by the looser `els_fallback` mechanism, a Poisson-subsampled Gaussian, which RDP composes.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import Domain, PoissonSubsampledGaussianPRV
from scipy import stats

from ..logs import get_logger
from .rng import DISC_MISS, MAX_RELEASE_COORDINATES, tail_mass

if TYPE_CHECKING:
    from .ledger import MechanismGroup

logger = get_logger(__name__)

SUPPORTED_ACCOUNTANTS = ("prv", "rdp")

# opacus' PRV defaults: the bound includes +eps_error, and is taken at δ - delta_error. (opacus flags
# its domain-size rule as adapted from the authors' code, safe for eps_error < 1; ours is 0.01.)
_PRV_EPS_ERROR = 0.01
_PRV_DELTA_ERROR_FRACTION = 1e-3
# PRV discretises the privacy loss on a grid whose size grows with the RDP ε of the history and with
# √steps; at small σ it explodes (σ=0.1, q=0.01, 1000 steps: ~2e8 points, 13 minutes, gigabytes).
# Past this size (~1.5 GB and ~10 s; a 100k-step run at σ=1, q=0.01 is just below it) the RDP bound,
# also rigorous, is used instead.
_PRV_MAX_GRID = 2**23


def check_accountant(accountant: str) -> None:
    """Raise a ValueError naming the choices when `accountant` is not one we report guarantees with."""
    if accountant not in SUPPORTED_ACCOUNTANTS:
        raise ValueError(
            f"Unknown accountant {accountant!r}: choose one of {', '.join(SUPPORTED_ACCOUNTANTS)}. "
            "(GDP/CLT is an approximation, not an upper bound, so it cannot certify a guarantee.)"
        )


def _examples_per_user(group: MechanismGroup) -> int:
    """k of an ELS event; 1 for every other event (one example moves the sum by at most C: J ~ Binomial(1, q)).

    Only ELS events carry `examples_per_user` (`MechanismGroup` refuses it on any other type).
    """
    return 1 if group.examples_per_user is None else int(group.examples_per_user)


def _events(mechanisms: Sequence[MechanismGroup]) -> list[tuple[float, float, int, int]]:
    """(σ, q, k, steps), one per distinct (σ, q, k); k = 1 for a Poisson-subsampled Gaussian, whose mixture
    Binomial(1, q) is exactly that mechanism, so an ELS event with k = 1 is one.

    Composition is order-independent for every accountant here, so equal mechanisms are merged wherever
    they occur: the result is the same and PRV/PLD convolve fewer distributions.
    """
    steps: dict[tuple[float, float, int], int] = {}
    for group in mechanisms:
        if group.steps > 0:
            key = (float(group.noise_multiplier), float(group.sample_rate), _examples_per_user(group))
            steps[key] = steps.get(key, 0) + int(group.steps)
    return [(sigma, q, k, n) for (sigma, q, k), n in steps.items()]


def els_fallback(noise_multiplier: float, sample_rate: float, examples_per_user: int) -> tuple[float, float]:
    """(σ', q') of the Poisson-subsampled Gaussian that dominates one ELS release (σ, q, k): σ' = σ/k (sensitivity
    k·C) and q' = 1 − (1 − q)^k (the chance that any of the user's k examples is sampled).

    Why it dominates, in both directions (add and remove a user). With b_j = Binom(k, q)[j] and Q = N(0, σ²), the
    release is P = Σ_j b_j N(j, σ²) = (1 − q')·Q + q'·M, M = Σ_{j≥1} (b_j/q') N(j, σ²), and the fallback is
    P' = (1 − q')·Q + q'·N(k, σ²). (1) The hockey-stick divergence H_γ is jointly convex, so both H_γ(P‖Q) and
    H_γ(Q‖P) are at most the average, with weights b_j/q' over j ≥ 1, of the same divergence with
    P'_j = (1 − q')·Q + q'·N(j, σ²) in place of P (Σ_{j≥1} (b_j/q')·P'_j = P). (2) For 1 ≤ j ≤ k the kernel
    x ↦ (j/k)·x + N(0, σ²(1 − j²/k²)) maps N(0, σ²) to itself and N(k, σ²) to N(j, σ²), hence (Q, P'_k) to
    (Q, P'_j): by data processing each term is at most the j = k one, and P'_k = P'. Loose: k·C is charged
    whenever any example of the user is sampled (here it is looser than group privacy of the example-level
    guarantee, see tests/privacy/test_user_level_accounting.py).
    """
    k = int(examples_per_user)
    any_sampled = 1.0 if sample_rate >= 1 else -math.expm1(k * math.log1p(-sample_rate))
    return noise_multiplier / k, any_sampled


def _fallback_history(events: Sequence[tuple[float, float, int, int]]) -> list[tuple[float, float, int]]:
    """opacus history tuples with every ELS event replaced by `els_fallback`, merged as in `_events`."""
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, k, n in events:
        key = (sigma, q) if k == 1 else els_fallback(sigma, q, k)
        steps[key] = steps.get(key, 0) + n
    return [(sigma, q, n) for (sigma, q), n in steps.items()]


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence opacus' numerical chatter that does not affect the bound.

    "Optimal order is the smallest/largest alpha": the RDP bound is still valid, only looser (we keep
    opacus' default orders, which the reference tables use); overflow in PRV's far tails.
    """
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.filterwarnings("ignore", message="Optimal order")
        yield


# The RDP orders opacus' RDPAccountant (and its PRV domain rule) uses; the reference tables use them too.
_RDP_ORDERS: tuple[float, ...] = tuple(RDPAccountant.DEFAULT_ALPHAS)


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(sigma: float, q: float) -> np.ndarray:
    """RDP at every order of one step of the Poisson-subsampled Gaussian mechanism (σ, q), read-only.

    It depends on (σ, q) only, and k steps compose to k times it, so it is computed once per mechanism:
    it takes ~0.05 s (the fractional orders integrate numerically) and every ε evaluation needs it, PRV's
    domain rule twice. The values are opacus' own (`_compute_rdp`, the function its `compute_rdp` maps).
    """
    with _quiet():
        curve = np.array([rdp_analysis._compute_rdp(q, sigma, order) for order in _RDP_ORDERS])
    curve.flags.writeable = False
    return curve


def _rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """RDP's ε at `delta`: the same arithmetic as opacus' RDPAccountant.get_epsilon, on the cached curves."""
    rdp = sum([_rdp_per_step(sigma, q) * steps for sigma, q, steps in history])
    with _quiet():
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(_RDP_ORDERS), rdp=rdp, delta=delta)
    return float(epsilon)


def _safe_domain_half_width(history: Sequence[tuple[float, float, int]], eps_error: float,
                            delta_error: float) -> float:
    """Half-width L of the privacy-loss interval PRV discretises on (Gopi et al. 2021, remark 5.6).

    The truncated mass must stay below the δ error: L covers the RDP ε of the whole composition at
    δ_err/4 and of every single step at δ_err/(8·steps), plus a margin of 3 (the rule of the authors' code,
    which opacus' `compute_safe_domain_size` also follows; we compute it here from the cached RDP curves,
    so the grid and therefore ε are those opacus' PRVAccountant gives, at a fraction of the cost).
    """
    total = sum(steps for _, _, steps in history)
    half_width = _rdp_epsilon(history, delta_error / 4)
    for sigma, q, _ in history:
        half_width = max(half_width, _rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total)))
    return max(half_width, eps_error) + 3


def _prv_mesh(total_steps: int, eps_error: float, delta_error: float) -> float:
    """PRV's grid spacing (opacus' rule, with its numpy arithmetic so the grid is bit-identical)."""
    return eps_error / np.sqrt(total_steps * np.log(12 / delta_error) / 2)


class _CachedPRVAccountant(PRVAccountant):
    """opacus' PRVAccountant, its discretisation domain computed from the cached per-step RDP curves."""

    def _get_domain(self, prvs: list[PoissonSubsampledGaussianPRV], num_self_compositions: list[int],
                    eps_error: float, delta_error: float) -> Domain:
        history = [(prv.noise_multiplier, prv.sample_rate, k) for prv, k in zip(prvs, num_self_compositions)]
        half_width = _safe_domain_half_width(history, eps_error, delta_error)
        return Domain.create_aligned(-half_width, half_width,
                                     _prv_mesh(sum(num_self_compositions), eps_error, delta_error))


def _prv_grid_size(history: list[tuple[float, float, int]], delta: float) -> float:
    """Number of points opacus' PRVAccountant would discretise the history on (its own domain rule)."""
    delta_error = delta * _PRV_DELTA_ERROR_FRACTION
    half_width = _safe_domain_half_width(history, _PRV_EPS_ERROR, delta_error)
    mesh = _prv_mesh(sum(steps for _, _, steps in history), _PRV_EPS_ERROR, delta_error)
    return float(2 * half_width / mesh)


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> tuple[float, str]:
    """PRV's ε, or RDP's where PRV cannot run; the second item names the accountant that gave it."""
    grid = _prv_grid_size(history, delta)
    if grid > _PRV_MAX_GRID:
        logger.info(
            "PRV would need a %.3g-point grid for this history (ε is very large); using the RDP bound, "
            "which is also a rigorous upper bound.", grid,
        )
        return _rdp_epsilon(history, delta), "rdp"
    accountant = _CachedPRVAccountant()
    accountant.history = history
    try:
        with _quiet():
            epsilon = accountant.get_epsilon(
                delta, eps_error=_PRV_EPS_ERROR, delta_error=delta * _PRV_DELTA_ERROR_FRACTION
            )
        return float(epsilon), "prv"
    except (RuntimeError, ValueError) as err:  # opacus' numerical guards: "Cannot compute epsilon", ...
        logger.warning("PRV accounting failed (%s); using the RDP bound, also a rigorous upper bound.", err)
        return _rdp_epsilon(history, delta), "rdp"


@functools.lru_cache(maxsize=256)
def _els_tail_mass(sigma: float, q: float, k: int) -> float:
    """Per ELS release (k ≥ 2), the sampler-tail mass: Σ_{j=1..k} Binom(k, q)[j] · tail_mass(σ/j).

    Given that j of the user's examples were sampled, the neighbour's mean moves by at most j·C, i.e. by j/σ std:
    `rng.tail_mass(σ/j)`'s case; j = 0 moves nothing, and J is drawn independently of the noise, so the mass
    outside the discs averages over J. Here the sampling *is* claimed (for the Poisson-subsampled Gaussian it is
    not, see `sampler_tail_delta`): charging the worst shift k/σ every release would make ELS vacuous (at σ = 1,
    k = 16 a 16-std shift lies beyond Z_MAX ≈ 9.4 std).
    """
    probs = stats.binom.pmf(np.arange(1, k + 1), k, q)
    return min(1.0, math.fsum(float(p) * tail_mass(sigma / j) for j, p in enumerate(probs, start=1) if p > 0))


def _tail_mass_per_release(sigma: float, q: float, k: int) -> float:
    return tail_mass(sigma) if k == 1 else _els_tail_mass(sigma, q, k)


# dp_accounting's PLD (the tight ELS accountant). The privacy loss is discretised on a grid of this spacing, or
# coarser where one release's loss spans more than _PLD_MAX_POINTS of it: building a mixture's distribution costs
# ~50 µs per point (σ = 1, q = 0.01, k = 16: 85k points at 1e-3, 4.6 s), composing it is cheap. The rounding is
# pessimistic, so any spacing gives an upper bound; 1e-3 is within 1e-3 of the 1e-4 figure at 1000 steps.
PLD_LABEL = "pld"
_PLD_MIN_INTERVAL = 1e-3
_PLD_MAX_POINTS = 2**15


def els_mixture(sample_rate: float, examples_per_user: int) -> tuple[list[float], list[float]]:
    """The sensitivities 0..k (units of C) and their probabilities Binomial(k, q) of one ELS release."""
    k = int(examples_per_user)
    return [float(j) for j in range(k + 1)], [float(p) for p in stats.binom.pmf(np.arange(k + 1), k, sample_rate)]


def _privacy_losses(sigma: float, q: float, k: int) -> list:
    """dp_accounting's privacy-loss objects of one release (σ, q, k), remove and add directions."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    directions = (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD)
    if k == 1:
        return [plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=a) for a in directions]
    sensitivities, probs = els_mixture(q, k)
    return [plm.MixtureGaussianPrivacyLoss(sigma, sensitivities, probs, adjacency_type=a) for a in directions]


def _pld_interval(events: Sequence[tuple[float, float, int, int]]) -> float:
    """One grid spacing for the whole history (dp_accounting composes only equal spacings): _PLD_MIN_INTERVAL, or
    the widest release's loss range over _PLD_MAX_POINTS."""
    width = 0.0
    for sigma, q, k, _ in events:
        for loss in _privacy_losses(sigma, q, k):
            bounds = loss.connect_dots_bounds()
            width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
    return max(_PLD_MIN_INTERVAL, width / _PLD_MAX_POINTS)


@functools.lru_cache(maxsize=32)
def _pld_per_step(sigma: float, q: float, k: int, interval: float):
    """dp_accounting's privacy-loss distribution of one release (σ, q, k) on the grid `interval`, both directions.

    Cached: the ledger asks for ε after every step, with the same releases and one more step.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    if k == 1:
        return pld.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval)
    sensitivities, probs = els_mixture(q, k)
    return pld.from_mixture_gaussian_mechanism(sigma, sensitivities, probs, value_discretization_interval=interval)


def _pld_epsilon(events: list[tuple[float, float, int, int]], delta: float) -> tuple[float, str]:
    """ε of the whole history from dp_accounting's PLD accountant, or the RDP bound of `_fallback_history` where
    it cannot run; the second item names the accountant that gave it.

    What `PLDAccountant(value_discretization_interval=_pld_interval(events))` gives composing
    `MixtureOfGaussiansDpEvent(σ, [0..k], Binom(k, q))` (ELS) and `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`
    (the others) `steps` times each, built here from the same dp_accounting functions, one release's distribution
    cached and self-composed.
    """
    try:
        with _quiet():
            interval = _pld_interval(events)
            composed = None
            for sigma, q, k, steps in events:
                step = _pld_per_step(sigma, q, k, interval).self_compose(steps)
                composed = step if composed is None else composed.compose(step)
            epsilon = float(composed.get_epsilon_for_delta(delta))
        if not math.isnan(epsilon):
            return epsilon, PLD_LABEL
        raise ValueError("ε is NaN")
    except (ArithmeticError, RuntimeError, ValueError) as err:
        logger.warning("PLD accounting failed (%s); using the RDP bound of the Poisson-subsampled Gaussian that "
                       "dominates each ELS release (els_fallback), also a rigorous upper bound.", err)
        return _rdp_epsilon(_fallback_history(events), delta), "rdp"


def sampler_tail_delta(mechanisms: Sequence[MechanismGroup], delta: float) -> float:
    """The part of `delta` the noise sampler's finite tail takes (see `rng.tail_mass`); ε is the accountant's at
    `delta` minus this.

    Two terms over the k noised releases: Σ steps · tail_mass(σ) (union bound; Poisson sampling would lower it by
    q, which is not claimed; an ELS release counts `_els_tail_mass` instead), then the disc restriction, which
    multiplies the accountant's δ by at most Z^(−k), Z = (1 − 2⁻⁶⁴)^MAX_RELEASE_COORDINATES: the accountant gets
    (δ − Σ)·Z^k. At least `delta` when Σ alone reaches it: no finite ε then.
    """
    noised = [(sigma, q, k, steps) for sigma, q, k, steps in _events(mechanisms) if sigma > 0]
    tail = math.fsum(steps * _tail_mass_per_release(sigma, q, k) for sigma, q, k, steps in noised)
    if tail >= delta:
        return tail
    pairs = sum(steps for *_, steps in noised) * MAX_RELEASE_COORDINATES
    return tail + (delta - tail) * -math.expm1(pairs * math.log1p(-DISC_MISS))


def compute_epsilon(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> float:
    """ε at `delta` of the composition of every group (σ, q, steps; k for an ELS event), an upper bound from
    `accountant` at δ minus `sampler_tail_delta`.

    Empty history → 0.0; any group with σ = 0 and steps > 0 releases a clipped sum unnoised → inf; so does a
    history whose sampler tail alone spends `delta`.
    """
    return epsilon_bound(mechanisms, delta, accountant)[0]


def epsilon_bound(mechanisms: Sequence[MechanismGroup], delta: float, accountant: str) -> tuple[float, str]:
    """`compute_epsilon`, plus the accountant that produced the bound: "prv", "rdp", or "pld" (dp_accounting's PLD
    accountant, which "prv" uses for a whole history that holds an ELS event of k ≥ 2; see the module docstring).

    Reports name the latter: where PRV cannot run and RDP stands in, the card must say so, so that
    whoever recomputes ε from the card's mechanisms uses the accountant that gave the number.
    """
    check_accountant(accountant)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    events = _events(mechanisms)
    if not events:
        return 0.0, accountant
    if any(sigma == 0 for sigma, *_ in events):
        return math.inf, accountant
    accountant_delta = delta - sampler_tail_delta(mechanisms, delta)
    if accountant_delta <= 0:
        return math.inf, accountant
    if any(k > 1 for _, _, k, _ in events):
        if accountant == "rdp":
            return _rdp_epsilon(_fallback_history(events), accountant_delta), "rdp"
        return _pld_epsilon(events, accountant_delta)
    history = [(sigma, q, n) for sigma, q, _, n in events]
    if accountant == "rdp":
        return _rdp_epsilon(history, accountant_delta), "rdp"
    return _prv_epsilon(history, accountant_delta)
