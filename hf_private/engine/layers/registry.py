"""Layer type → dedicated handler table. Exact types only: a subclass may override `forward` and change the math
(it is then probed like any other module, `rules.py`). FSDP2's `fully_shard` swaps a module's class for a subclass
(FSDP<class>) that changes no math: the table reads through it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .base import LayerHandler

_HANDLERS: dict[type[nn.Module], LayerHandler] = {}


def register_layer(*module_types: type[nn.Module]) -> Callable[[type[LayerHandler]], type[LayerHandler]]:
    def decorate(handler_cls: type[LayerHandler]) -> type[LayerHandler]:
        for module_type in module_types:
            _HANDLERS[module_type] = handler_cls()
        return handler_cls

    return decorate


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The dedicated rule registered for the module's exact type (under FSDP2's subclass), if any.

    Without reading through FSDP2's class a sharded embedding or head took the generic rule, which replays the forward
    with the module's weight: in backward that weight is still the resharded DTensor when FSDP2 does not unshard the
    module again (a chunk whose parameters are frozen for ghost differentiation), and the replay gave wrong terms."""
    return _HANDLERS.get(_own_type(module))


def _own_type(module: nn.Module) -> type[nn.Module]:
    """The module's class, under FSDP2's FSDP<class> subclass if it has one."""
    for klass in type(module).__mro__:
        if issubclass(klass, nn.Module) and not issubclass(klass, FSDPModule):
            return klass
    return type(module)


def supported_layer_names() -> list[str]:
    """The layer types with a dedicated rule (every other module is probed for a matched rule, else takes the
    generic one)."""
    return sorted(t.__name__ for t in _HANDLERS)
