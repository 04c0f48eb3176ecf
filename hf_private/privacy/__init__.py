"""Privacy accounting: the plan of a run's stages (q, steps, δ, jointly calibrated σ), the ledger of typed events
it releases (`events`), ε from the registered accountants (opacus' PRV/RDP, dp_accounting's PLD for user-level ELS
events), noise calibration to a target ε, and the secret generator for noise and sampling."""

from .accountants import SUPPORTED_ACCOUNTANTS, compute_epsilon
from .calibration import (
    BudgetError,
    JointMechanism,
    calibrate_jointly,
    calibrate_noise_multiplier,
    max_steps_within,
)
from .events import ELS_POISSON_GAUSSIAN, NO_GUARANTEE, POISSON_GAUSSIAN, MechanismGroup
from .ledger import PrivacyLedger
from .noise import GaussianNoise
from .plan import PlannedStage, PrivacyPlan, Stage, resolve_delta
from .rng import GaussianSampler, SecretRandom

__all__ = [
    "ELS_POISSON_GAUSSIAN",
    "NO_GUARANTEE",
    "POISSON_GAUSSIAN",
    "SUPPORTED_ACCOUNTANTS",
    "BudgetError",
    "GaussianNoise",
    "GaussianSampler",
    "JointMechanism",
    "MechanismGroup",
    "PlannedStage",
    "PrivacyLedger",
    "PrivacyPlan",
    "SecretRandom",
    "Stage",
    "calibrate_jointly",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "max_steps_within",
    "resolve_delta",
]
