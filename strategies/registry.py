"""The strategy registry: ``@register_strategy("name")``, ``create(name, **kwargs)``, ``available()``.

Adding a strategy is one decorated class in a new module of ``strategies/rules/`` (discovered on
import of :mod:`strategies`, see ``strategies/__init__.py``) or in another installed package that
declares an entry point in the ``scalelab.strategies`` group — like timm's model registry
(:func:`load_plugins`). Entry points load lazily, at the first :func:`available`, :func:`get` or
:func:`create` (``import strategies`` runs no foreign code). A plugin never replaces a strategy
already registered (a built-in name is refused, naming the class that holds it), and a plugin that
fails to load is skipped with one warning: one broken package does not stop every run.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["PLUGIN_GROUP", "PluginWarning", "UnknownStrategyError", "available", "create", "get", "load_plugins",
           "register_strategy"]

_REGISTRY: dict[str, type["Strategy"]] = {}
_plugins_loaded = False  # the entry points are loaded at the first lookup, not at import
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


def _load_plugins_once() -> None:
    """Load the entry points of :data:`PLUGIN_GROUP` at the first lookup of the registry."""
    if not _plugins_loaded:
        load_plugins()


def available() -> list[str]:
    """Sorted names of every registered strategy (the plugins' included)."""
    _load_plugins_once()
    return sorted(_REGISTRY)


def get(name: str) -> type["Strategy"]:
    """The class registered as ``name``; :class:`UnknownStrategyError` lists the registered ones."""
    _load_plugins_once()
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
    the plugin and the reason. The others still load. Called with the default group (explicitly or
    by the first lookup), it marks the plugins loaded: later lookups do not load them again.
    """
    global _plugins_loaded
    if group == PLUGIN_GROUP:
        _plugins_loaded = True  # first: a plugin that looks a name up while it loads does not recurse
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
