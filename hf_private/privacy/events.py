"""The ledger's event vocabulary: the typed releases a run records and every accountant composes.

Events are typed (in the spirit of Google dp_accounting's `DpEvent`s), by `MechanismGroup.mechanism`:

* `"poisson_gaussian"` (`POISSON_GAUSSIAN`): a Poisson-subsampled Gaussian mechanism (σ, q), e.g. a DP-SGD
  step, a DP-FROST selection round, a stage of a two-stage method. What opacus' accountants compose.
* `"no_guarantee"` (`NO_GUARANTEE`): a release with no finite guarantee, with the reason (e.g. DP-FP in paper
  mode trains the encoder below its noise on raw data). Serialised with the accounting stand-in σ = 0, q = 1 (an
  un-noised release of the whole dataset), so that any accountant given the card's numbers, ours or opacus' or
  one that ignores the event type, returns ε = ∞ rather than a finite number the release does not have.
* `"els_poisson_gaussian"` (`ELS_POISSON_GAUSSIAN`): user-level DP by example-level sampling (ELS, Charles et al.
  2024, arXiv 2407.07737). Every user keeps at most k = `examples_per_user` examples; *examples* are
  Poisson-sampled at rate q, clipped to C, and N(0, σ²C²) is added to the sum. Adding or removing one user moves
  the sum by at most J·C, J ~ Binomial(k, q): per release a mixture of Gaussians, N(0, σ²) against
  Σ_j Binom(k, q)[j]·N(j, σ²) in units of C (a user with fewer than k examples is the case where some contribute
  0; the vector case reduces to this scalar one, Choquette-Choo et al. 2023, Cor. 4.7), which `accountants`
  composes with dp_accounting's PLD accountant. σ and q are the mechanism's own (the noise multiplier and the
  per-example rate), so an accountant that ignores the event type and k would *understate* ε: read these events
  with `MechanismGroup.from_dict`.

It sits at the bottom of `privacy/` so that the ledger, the accountants, calibration and the plan (and, above
them, the audit and the card) share one vocabulary without importing each other.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .banded_inverse import sensitivity as banded_inverse_sensitivity

POISSON_GAUSSIAN = "poisson_gaussian"
NO_GUARANTEE = "no_guarantee"
ELS_POISSON_GAUSSIAN = "els_poisson_gaussian"
# Amplified BandMF (`band_mf`): `steps` training steps with b-banded correlated noise and b-min-sep Poisson sampling at
# q̂ per partition; by Theorem 4 of arXiv 2306.08153 exactly as private as ⌈steps/b⌉ Poisson-subsampled Gaussian
# releases (q̂, σ) (`merged_releases`). Each step still draws fresh noise (the sampler tail counts every step).
BAND_MF = "band_mf"
# Banded-inverse MF (`band_inv_mf`, `banded_inverse`): `steps` steps of noise w_t = Σ_{j<b} d_j z_{t−j}, each example in
# one of b partitions (steps p, p + b, …), no amplification: one Gaussian mechanism C x + z, noise multiplier
# σ / sensitivity(b, steps), sampled at rate 1 (dp_accounting's GaussianDpEvent). Each step draws fresh noise.
BAND_INV_MF = "band_inv_mf"
EVENT_KINDS = (POISSON_GAUSSIAN, NO_GUARANTEE, ELS_POISSON_GAUSSIAN, BAND_MF, BAND_INV_MF)
# The event types whose release is noised by σ (a Gaussian mechanism): finite ε when σ > 0.
GAUSSIAN_KINDS = (POISSON_GAUSSIAN, ELS_POISSON_GAUSSIAN, BAND_MF, BAND_INV_MF)
# The event types that carry `bands`.
BANDED_KINDS = (BAND_MF, BAND_INV_MF)


@dataclass
class MechanismGroup:
    """`steps` consecutive releases of one mechanism: a typed ledger event.

    `mechanism` is the event type. For `"poisson_gaussian"` (the default) the release is a Poisson-subsampled
    Gaussian mechanism with noise multiplier σ and rate q; `max_grad_norm` (C) does not enter ε (noise is σ·C
    for sensitivity C) and is kept so the record says what was released. For `"no_guarantee"` the release has
    no finite guarantee, for the stated `reason`; σ and q hold the stand-in 0 and 1 (nothing is noised, everyone
    is in), so any accountant composes it to ε = ∞. Build those with `MechanismGroup.no_guarantee`. For
    `"els_poisson_gaussian"` the release is user-level example-level sampling: q is the per-*example* Poisson rate,
    σ the noise multiplier (noise σ·C), and `examples_per_user` (k ≥ 1) the cap on each user's examples; build
    those with `MechanismGroup.els`. `examples_per_user` is None for every other type.

    The fields' order is the serialised order (`to_dict`); `MechanismGroup.from_dict(group.to_dict())` rebuilds
    any group (positionally, `MechanismGroup(*group.to_dict().values())` rebuilds the Poisson-Gaussian and
    no-guarantee ones only: an ELS event has no `reason` entry before its `examples_per_user`).
    """

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    max_grad_norm: float | None = None
    mechanism: str = POISSON_GAUSSIAN
    reason: str | None = None
    examples_per_user: int | None = None
    # Adaptive clipping (`adaptive_clip`): the step also released the noisy unclipped count; this holds the joint
    # release's parts (gradient z_Δ, count σ_b, ...), `noise_multiplier` their effective σ. None for other releases.
    adaptive_clip: dict[str, float] | None = None
    # BandMF (`BAND_MF`): the number of bands b ≥ 1; None for every other event type.
    bands: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("A mechanism needs a name (e.g. 'dp-sgd').")
        if (self.mechanism in BANDED_KINDS) != (self.bands is not None):
            raise ValueError(f"A banded event, and only one, carries bands ({self.name!r}: {self.mechanism}).")
        if self.bands is not None and (isinstance(self.bands, bool) or int(self.bands) != self.bands or self.bands < 1):
            raise ValueError(f"bands of {self.name!r} must be a positive integer, got {self.bands!r}.")
        if self.mechanism not in EVENT_KINDS:
            raise ValueError(f"Unknown mechanism type {self.mechanism!r}: one of {', '.join(EVENT_KINDS)}.")
        if self.mechanism == NO_GUARANTEE:
            if not (isinstance(self.reason, str) and self.reason.strip()):
                raise ValueError(f"A no-guarantee event ({self.name!r}) must say why there is no guarantee.")
            if (self.noise_multiplier, self.sample_rate) != (0.0, 1.0):
                raise ValueError(
                    f"A no-guarantee event ({self.name!r}) is accounted as un-noised (noise_multiplier=0) on the "
                    f"whole dataset (sample_rate=1), got noise_multiplier={self.noise_multiplier}, sample_rate="
                    f"{self.sample_rate}: use MechanismGroup.no_guarantee(name, reason, steps)."
                )
        elif self.reason is not None:
            raise ValueError(f"Only a no-guarantee event carries a reason ({self.name!r} is {self.mechanism}).")
        if self.mechanism == ELS_POISSON_GAUSSIAN:
            k = self.examples_per_user
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
                raise ValueError(
                    f"An ELS event ({self.name!r}) needs examples_per_user, a positive integer (the cap "
                    f"k on each user's examples), got {k!r}."
                )
            self.examples_per_user = int(k)
        elif self.examples_per_user is not None:
            raise ValueError(
                f"Only an ELS event ({ELS_POISSON_GAUSSIAN!r}) carries examples_per_user ({self.name!r} "
                f"is {self.mechanism})."
            )
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}.")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}.")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {self.steps}.")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be finite and > 0, got {self.max_grad_norm}.")
        if self.adaptive_clip is not None:
            self._check_adaptive_clip()

    def _check_adaptive_clip(self) -> None:
        """An adaptive-clipping step is one Poisson-subsampled Gaussian at σ with z_Δ⁻² + (2σ_b)⁻² = σ⁻²
        (`adaptive_clip.effective_noise_multiplier`)."""
        facts = self.adaptive_clip or {}
        if self.mechanism != POISSON_GAUSSIAN:
            raise ValueError(f"Only a Poisson-Gaussian event has adaptive_clip ({self.name!r} is {self.mechanism}).")
        z_grad, sigma_b = facts.get("gradient_noise_multiplier"), facts.get("count_noise_std")
        if not (isinstance(z_grad, numbers.Real) and isinstance(sigma_b, numbers.Real) and z_grad > 0 and sigma_b > 0):
            raise ValueError(f"adaptive_clip of {self.name!r} needs gradient_noise_multiplier and count_noise_std > 0.")
        effective = (z_grad**-2 + (2.0 * sigma_b) ** -2) ** -0.5
        if not math.isclose(effective, self.noise_multiplier, rel_tol=1e-9):
            raise ValueError(
                f"adaptive_clip of {self.name!r}: z_Δ={z_grad} and σ_b={sigma_b} give σ={effective}, not the event's "
                f"noise_multiplier={self.noise_multiplier}."
            )
        self.adaptive_clip = {str(k): float(v) for k, v in facts.items()}

    @classmethod
    def no_guarantee(cls, name: str, reason: str, steps: int = 1, max_grad_norm: float | None = None) -> MechanismGroup:
        """`steps` releases with no finite guarantee (ε = ∞), for `reason`."""
        return cls(name, 0.0, 1.0, steps, max_grad_norm, NO_GUARANTEE, reason)

    @classmethod
    def els(
        cls,
        name: str,
        noise_multiplier: float,
        sample_rate: float,
        examples_per_user: int,
        steps: int = 1,
        max_grad_norm: float | None = None,
    ) -> MechanismGroup:
        """`steps` user-level ELS releases: examples Poisson-sampled at `sample_rate`, at most `examples_per_user`
        per user, noise σ·C (see the module docstring)."""
        return cls(
            name,
            noise_multiplier,
            sample_rate,
            steps,
            max_grad_norm,
            ELS_POISSON_GAUSSIAN,
            examples_per_user=examples_per_user,
        )

    @property
    def has_guarantee(self) -> bool:
        """False when this release alone makes ε infinite: a no-guarantee event, or a Gaussian one with σ = 0."""
        return self.steps == 0 or (self.mechanism in GAUSSIAN_KINDS and self.noise_multiplier > 0)

    def why_no_guarantee(self) -> str | None:
        if self.has_guarantee:
            return None
        if self.mechanism == NO_GUARANTEE:
            return f"{self.name}: {self.reason}"
        return f"{self.name}: {self.steps} release(s) without noise (noise_multiplier=0)."

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": str(self.name),
            "noise_multiplier": float(self.noise_multiplier),
            "sample_rate": float(self.sample_rate),
            "steps": int(self.steps),
            "max_grad_norm": None if self.max_grad_norm is None else float(self.max_grad_norm),
            "mechanism": str(self.mechanism),
        }
        if self.reason is not None:
            d["reason"] = str(self.reason)
        if self.examples_per_user is not None:
            d["examples_per_user"] = int(self.examples_per_user)
        if self.adaptive_clip is not None:
            d["adaptive_clip"] = dict(self.adaptive_clip)
        if self.bands is not None:
            d["bands"] = int(self.bands)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MechanismGroup:
        """From `to_dict`'s output, or a format-1 dict (no `mechanism`: a Poisson-subsampled Gaussian)."""
        max_grad_norm = d.get("max_grad_norm")
        reason = d.get("reason")
        examples_per_user = d.get("examples_per_user")
        return cls(
            name=str(d["name"]),
            noise_multiplier=float(d["noise_multiplier"]),
            sample_rate=float(d["sample_rate"]),
            steps=int(d["steps"]),
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            mechanism=str(d.get("mechanism", POISSON_GAUSSIAN)),
            reason=None if reason is None else str(reason),
            examples_per_user=None if examples_per_user is None else int(examples_per_user),
            adaptive_clip=d.get("adaptive_clip"),
            bands=None if d.get("bands") is None else int(d["bands"]),
        )

    def same_mechanism(self, other: MechanismGroup) -> bool:
        """Same release (type, name, σ, q, C, reason, k), so the two groups can be one with summed steps."""
        return self._identity() == other._identity()

    def _identity(self) -> tuple:
        return (
            self.mechanism,
            self.name,
            self.noise_multiplier,
            self.sample_rate,
            self.max_grad_norm,
            self.reason,
            self.examples_per_user,
            tuple(sorted((self.adaptive_clip or {}).items())),
            self.bands,
        )


def gaussian_event(
    name: str,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    max_grad_norm: float | None = None,
    examples_per_user: int | None = None,
    bands: int | None = None,
    banded_inverse: bool = False,
) -> MechanismGroup:
    """`steps` releases of a Gaussian mechanism: a Poisson-subsampled Gaussian (σ, q), or with `examples_per_user`
    = k a user-level ELS one (σ, per-example rate q, at most k examples per user), or with `bands` = b amplified
    BandMF steps (σ, per-partition rate q̂; `BAND_MF`), or with `banded_inverse` too banded-inverse steps
    (`BAND_INV_MF`; with b = 1 DP-SGD's Poisson-subsampled Gaussian, which they are)."""
    if bands is not None:
        if examples_per_user is not None:
            raise ValueError(f"{name!r}: BandMF (bands) has no user-level (examples_per_user) accounting.")
        if banded_inverse and bands == 1:
            return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm)
        kind = BAND_INV_MF if banded_inverse else BAND_MF
        return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm, kind, bands=bands)
    if examples_per_user is None:
        return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm)
    return MechanismGroup.els(name, noise_multiplier, sample_rate, examples_per_user, steps, max_grad_norm)


# How an audit run's mechanisms are named once composed into a report (`hf_private.audit.compose_audits`); the card
# reads it to tell whether an audit on the training data was composed into ε.
AUDIT_MECHANISM_PREFIX = "audit:"


class Releases(NamedTuple):
    """`steps` releases of one Gaussian mechanism as the accountants see it: σ, q, and k (1 unless an ELS event)."""

    noise_multiplier: float
    sample_rate: float
    examples_per_user: int
    steps: int


def _examples_per_user(group: MechanismGroup) -> int:
    """k of an ELS event; 1 for every other event (one example moves the sum by at most C: J ~ Binomial(1, q)).

    Only ELS events carry `examples_per_user` (`MechanismGroup` refuses it on any other type).
    """
    return 1 if group.examples_per_user is None else int(group.examples_per_user)


def releases_of(group: MechanismGroup, draws: bool = False) -> int:
    """The compositions an accountant counts for `group`: its steps, or ⌈steps/b⌉ for a BandMF event (each example
    takes part in at most that many of its steps); with `draws`, the noise draws made (every step's)."""
    if group.bands is None or draws:
        return int(group.steps)
    return -(-int(group.steps) // int(group.bands))


def _accounted(group: MechanismGroup, draws: bool) -> tuple[float, float, int]:
    """(σ, q, count) as the accountants compose `group`: a banded-inverse event is one un-amplified Gaussian release
    at σ / sensitivity (its `steps` draws for the sampler tail, each at that σ: the shift one draw sees is at most
    the sensitivity); any other its own σ and q, `releases_of` times."""
    if group.mechanism != BAND_INV_MF:
        return float(group.noise_multiplier), float(group.sample_rate), releases_of(group, draws)
    sigma = float(group.noise_multiplier) / banded_inverse_sensitivity(int(group.bands or 1), int(group.steps))
    return sigma, 1.0, int(group.steps) if draws else 1


def merged_releases(mechanisms: Sequence[MechanismGroup], draws: bool = False) -> list[Releases]:
    """One `Releases` per distinct (σ, q, k), in order of first appearance; k = 1 for a Poisson-subsampled Gaussian,
    whose mixture Binomial(1, q) is exactly that mechanism, so an ELS event with k = 1 is one.

    Composition is order-independent for every accountant here, so equal mechanisms are merged wherever
    they occur: the result is the same and PRV/PLD convolve fewer distributions.
    """
    steps: dict[tuple[float, float, int], int] = {}
    for group in mechanisms:
        if group.steps > 0:
            sigma, q, count = _accounted(group, draws)
            key = (sigma, q, _examples_per_user(group))
            steps[key] = steps.get(key, 0) + count
    return [Releases(sigma, q, k, n) for (sigma, q, k), n in steps.items()]
