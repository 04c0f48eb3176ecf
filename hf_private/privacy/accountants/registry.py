"""The accountants by name: "which ε" is a lookup here, so adding one is a file with `@register_accountant(name)`.

The package's `__init__` imports each accountant's file once, which registers it; every place that offers or
checks a choice of accountant (the plan, the ledger, `MethodConfig`, the audit command) reads this table.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Accountant

_ACCOUNTANTS: dict[str, Accountant] = {}


def register_accountant(name: str) -> Callable[[type[Accountant]], type[Accountant]]:
    """Class decorator: offer the `Accountant` subclass under `name` (once; its search seed registered before it)."""

    def register(cls: type[Accountant]) -> type[Accountant]:
        if not (isinstance(cls, type) and issubclass(cls, Accountant)):
            raise TypeError(f"register_accountant({name!r}) decorates an Accountant subclass, got {cls!r}.")
        if name in _ACCOUNTANTS:
            registered = type(_ACCOUNTANTS[name]).__name__
            raise ValueError(f"An accountant named {name!r} is already registered ({registered}).")
        if cls.search_seed is not None and cls.search_seed not in _ACCOUNTANTS:
            raise ValueError(
                f"Accountant {name!r} is seeded by {cls.search_seed!r}, which is not registered: import "
                "the seed's module first."
            )
        _ACCOUNTANTS[name] = cls()
        return cls

    return register


def registered_accountants() -> tuple[str, ...]:
    """The names an ε can be asked of, sorted."""
    return tuple(sorted(_ACCOUNTANTS))


def check_accountant(accountant: str) -> None:
    """Raise a ValueError naming the choices when `accountant` is not one we report guarantees with."""
    if accountant not in _ACCOUNTANTS:
        raise ValueError(
            f"Unknown accountant {accountant!r}: choose one of {', '.join(registered_accountants())}. "
            "(GDP/CLT is an approximation, not an upper bound, so it cannot certify a guarantee.)"
        )


def accountant_named(accountant: str) -> Accountant:
    """The registered accountant `accountant` (a ValueError naming the choices when there is none)."""
    check_accountant(accountant)
    return _ACCOUNTANTS[accountant]
