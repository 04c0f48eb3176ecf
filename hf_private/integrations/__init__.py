"""Trainer families `privatize()` wraps: per-unit losses, units and settings of TRL's trainers and the like.

`family_of(trainer_class)` finds the family of a Trainer class by its root class, looked up by dotted name in
`_FAMILIES`: the family's module is imported only when the class comes from it, so the core never imports TRL unless
a TRL trainer is the class being privatized. A new family is one module here and one row in `_FAMILIES`.
"""

from __future__ import annotations

import importlib

from .base import RefusedKeyword, RefusedSetting, TrainerFamily, dotted_name

__all__ = ["RefusedKeyword", "RefusedSetting", "TrainerFamily", "family_of", "trainer_name"]

# dotted name of the family's root class → the module (in this package) whose FAMILY describes it
_FAMILIES = {
    "trl.trainer.sft_trainer.SFTTrainer": "trl_sft",
    "trl.trainer.dpo_trainer.DPOTrainer": "trl_dpo",
}
_TRANSFORMERS = TrainerFamily()


def family_of(trainer_class: type) -> TrainerFamily:
    """The family of `trainer_class`: the nearest class of its MRO that roots one; transformers.Trainer's otherwise."""
    for cls in trainer_class.__mro__:
        module = _FAMILIES.get(dotted_name(cls))
        if module is not None:
            return importlib.import_module(f"{__name__}.{module}").FAMILY
    return _TRANSFORMERS


def trainer_name(trainer_class: type) -> str:
    """The trainer class a user chose, as `package.Class`: the class `privatize()` wrapped for its private class
    (hf_private's own classes are skipped), the user's class for a subclass of a private one."""
    for cls in trainer_class.__mro__:
        if not cls.__module__.startswith("hf_private."):
            return f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    return f"{trainer_class.__module__.split('.')[0]}.{trainer_class.__name__}"
