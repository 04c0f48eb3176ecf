"""Layer type → dedicated handler table. Exact types only: a subclass may override `forward` and change the math
(it is then probed like any other module, `rules.py`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .base import LayerHandler

_HANDLERS: dict[type[nn.Module], LayerHandler] = {}


def register_layer(*module_types: type[nn.Module]) -> Callable[[type[LayerHandler]], type[LayerHandler]]:
    def decorate(handler_cls: type[LayerHandler]) -> type[LayerHandler]:
        for module_type in module_types:
            _HANDLERS[module_type] = handler_cls()
        return handler_cls

    return decorate


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The dedicated rule registered for the module's exact type, if any."""
    return _HANDLERS.get(type(module))


def supported_layer_names() -> list[str]:
    """The layer types with a dedicated rule (every other module is probed for a matched rule, else takes the
    generic one)."""
    return sorted(t.__name__ for t in _HANDLERS)
