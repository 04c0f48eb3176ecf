"""Layer type → handler table. Exact types only: a subclass may override `forward` and change the math."""

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
    return _HANDLERS.get(type(module))


def supported_layer_names() -> list[str]:
    """Every supported layer type, with what of it may train when that is not all of it ("Conv2d (bias only; weight
    refused)"), so an error listing them never suggests that a refused parameter would work."""
    return sorted(_describe(t.__name__, handler) for t, handler in _HANDLERS.items())


def _describe(name: str, handler: LayerHandler) -> str:
    if not handler.refused:
        return name
    return f"{name} ({', '.join(handler.params)} only; {', '.join(handler.refused)} refused)"
