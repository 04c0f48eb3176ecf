"""One folder per DP method (config + behaviour), found here rather than listed.

Importing this package imports every subpackage of it (`import_method_folders`); a method folder's own `__init__.py`
registers its method (`register_dp_method` on its method class, for its config class). The registered methods'
config classes are then attributes of this package (`hf_private.methods.BitFitConfig`, looked up in the registry by
`__getattr__`), so adding a method is adding its folder: nothing here names it. `base.py` holds the config base, the
method base and the registry, `shared.py` what several methods use.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    DPMethod,
    MethodConfig,
    RecipeDefaults,
    method_class,
    register_dp_method,
    registered_methods,
)

__all__ = ["DPMethod", "MethodConfig", "RecipeDefaults", "method_class", "register_dp_method", "registered_methods"]


def import_method_folders() -> list[str]:
    """Import every method folder, a subpackage of this package (each registers its method when imported, once);
    return their module names, in name order."""
    folders = [module.name for module in pkgutil.iter_modules(__path__, prefix=f"{__name__}.") if module.ispkg]
    for folder in folders:
        importlib.import_module(folder)
    return folders


def config_classes() -> dict[str, type[MethodConfig]]:
    """The registered methods' config classes by class name (`DPConfig`, `BitFitConfig`, ...)."""
    classes = (method_class(name).config_class for name in registered_methods())
    return {config_class.__name__: config_class for config_class in classes}


def __getattr__(name: str) -> type[MethodConfig]:
    config_class = config_classes().get(name)
    if config_class is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return config_class


def __dir__() -> list[str]:
    return sorted({*globals(), *config_classes()})


import_method_folders()
__all__ += sorted(config_classes())  # DPConfig, BitFitConfig, ...: every config a method folder registered
