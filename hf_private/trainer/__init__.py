"""Trainer glue: the only package that knows `transformers.Trainer`'s hooks (construction refusals, the private
class factory, the training hooks, the publishing hooks)."""

from .mixin import PrivateTrainingMixin
from .privatize import PrivateTrainer, privatize

__all__ = ["PrivateTrainer", "PrivateTrainingMixin", "privatize"]
