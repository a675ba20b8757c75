"""The strategy registry: ``@register_strategy("name")``, ``create(name, **kwargs)``, ``available()``.

Adding a strategy is one decorated class in a new module of this package (discovered on import
of :mod:`strategies`, see ``strategies/__init__.py``) or in another installed package that
declares an entry point in the ``scalelab.strategies`` group — like timm's model registry
(:func:`load_plugins`). A plugin never replaces a strategy already registered (a built-in name is
refused, naming the class that holds it), and a plugin that fails to load is skipped with one
warning: one broken package does not stop every run.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from strategies.base import Strategy

_REGISTRY: dict[str, type["Strategy"]] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

S = TypeVar("S", bound="type[Strategy]")
PLUGIN_GROUP = "scalelab.strategies"


class UnknownStrategyError(ValueError):
    """Raised by :func:`create` for a name that is not registered."""


class PluginWarning(UserWarning):
    """A ``scalelab.strategies`` entry point that was skipped (it failed to load, or it would
    replace a registered strategy)."""


def register_strategy(name: str) -> Callable[[S], S]:
    """Class decorator: register ``cls`` under ``name`` and set ``cls.name``."""
    if not _NAME.match(name):
        raise ValueError(f"strategy name must match {_NAME.pattern}, got {name!r}")

    def decorator(cls: S) -> S:
        existing = _REGISTRY.get(name)
        # The same class defined again (a module reloaded) may re-register; any other class may not.
        if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
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


def load_plugins(group: str = PLUGIN_GROUP) -> list[str]:
    """Load every entry point of ``group`` (each imports a module that registers strategies);
    return the names of those loaded.

    A plugin that raises while loading, or that registers a name already registered (a built-in
    included) — through :func:`register_strategy` or by editing the registry — is skipped: the
    registry is restored to what it was before that plugin, and one :class:`PluginWarning` names
    the plugin and the reason. The others still load.
    """
    loaded = []
    for ep in importlib.metadata.entry_points(group=group):
        before = dict(_REGISTRY)
        try:
            ep.load()
            replaced = [name for name, cls in before.items() if _REGISTRY.get(name) is not cls]
            if replaced:
                raise ValueError(f"it replaces the registered strategy {replaced[0]!r}")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of foreign code: skip it
            _REGISTRY.clear()
            _REGISTRY.update(before)
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            warnings.warn(f"strategy plugin {ep.name!r} ({ep.value}) skipped: {reason}", PluginWarning, stacklevel=2)
            continue
        loaded.append(ep.name)
    return loaded
