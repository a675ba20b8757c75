"""The strategy registry: ``@register_strategy("name")``, ``create(name, **kwargs)``, ``available()``.

Adding a strategy is one decorated class in a new module of this package (discovered on import
of :mod:`strategies`, see ``strategies/__init__.py``) or in another installed package that
declares an entry point in the ``scalelab.strategies`` group — like timm's model registry.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from strategies.base import Strategy

_REGISTRY: dict[str, type["Strategy"]] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

S = TypeVar("S", bound="type[Strategy]")


class UnknownStrategyError(ValueError):
    """Raised by :func:`create` for a name that is not registered."""


def register_strategy(name: str) -> Callable[[S], S]:
    """Class decorator: register ``cls`` under ``name`` and set ``cls.name``."""
    if not _NAME.match(name):
        raise ValueError(f"strategy name must match {_NAME.pattern}, got {name!r}")

    def decorator(cls: S) -> S:
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(
                f"strategy name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def available() -> list[str]:
    """Sorted names of every registered strategy."""
    return sorted(_REGISTRY)


def get(name: str) -> type["Strategy"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; available: {', '.join(available())}"
        ) from None


def create(name: str, *args: Any, **kwargs: Any) -> "Strategy":
    """Build the strategy registered as ``name``; ``args``/``kwargs`` as GradScaler's (device
    first, then init_scale, ...) plus the rule's own keywords, validated by its ``Params``."""
    return get(name)(*args, **kwargs)
