"""One folder per DP method: its config and what it makes trainable."""

from __future__ import annotations

from .bitfit import BitFitConfig
from .dpsgd import DPConfig

_CONFIG_CLASSES: dict[str, type[DPConfig]] = {cls.method: cls for cls in (DPConfig, BitFitConfig)}


def config_class_for(method: str) -> type[DPConfig]:
    try:
        return _CONFIG_CLASSES[method]
    except KeyError:
        raise ValueError(f"Unknown DP method {method!r}; known: {sorted(_CONFIG_CLASSES)}.") from None


__all__ = ["BitFitConfig", "DPConfig", "config_class_for"]
