"""Privacy accounting: the ledger of released mechanisms, ε from opacus' PRV/RDP accountants, noise
calibration to a target ε, and the secret generator for noise and sampling."""

from .accountants import SUPPORTED_ACCOUNTANTS, compute_epsilon
from .calibration import BudgetError, calibrate_noise_multiplier, max_steps_within
from .ledger import MechanismGroup, PrivacyLedger
from .noise import GaussianNoise
from .rng import GaussianSampler, SecretRandom

__all__ = [
    "SUPPORTED_ACCOUNTANTS",
    "BudgetError",
    "GaussianNoise",
    "GaussianSampler",
    "MechanismGroup",
    "SecretRandom",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "max_steps_within",
]
