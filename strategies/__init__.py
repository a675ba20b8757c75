"""scalelab strategies: drop-in replacements for ``torch.amp.GradScaler``.

>>> import strategies
>>> scaler = strategies.create("native")        # exactly torch's GradScaler rule
>>> strategies.available()                       # every registered strategy
>>> strategies.replay(trace, "megatron")         # what a rule would have done on a recorded trace

Every module of ``strategies/rules/`` is imported here, so a strategy added as one new file that uses
``@register_strategy`` is discovered with no other edit. Other installed packages can add
strategies through the ``scalelab.strategies`` entry-point group; those load at the first
``available()``, ``get()`` or ``create()``, not here. ``import strategies`` loads the library only:
the doctor is ``import strategies.doctor``.

``dir(strategies)`` lists :data:`__all__` and the submodules a user of the library reaches for:
``rules`` (one module per rule), ``base``, ``params``, ``state`` and ``validation`` (what a new
rule is written with), ``registry``, ``stats``, ``boundaries`` (the layer boundaries the
precision hooks share) and, once imported, ``doctor``.
"""

from __future__ import annotations

import importlib
import pkgutil

from strategies import rules
from strategies.base import Strategy
from strategies.registry import UnknownStrategyError, available, create, get, register_strategy
from strategies.stats import GradStats, unscale_and_stats
from strategies.tracing import Trace, TraceRecorder, replay

__all__ = [
    "GradStats",
    "Strategy",
    "Trace",
    "TraceRecorder",
    "UnknownStrategyError",
    "available",
    "create",
    "get",
    "register_strategy",
    "replay",
    "unscale_and_stats",
]

_API_MODULES = ("base", "boundaries", "doctor", "params", "registry", "rules", "state", "stats", "tracing", "validation")
"""The submodules :func:`__dir__` lists beside :data:`__all__` (``doctor`` once imported)."""


def __dir__() -> list[str]:
    return sorted([*__all__, *(m for m in _API_MODULES if m in globals())])


def _discover() -> None:
    """Import every module of ``strategies/rules/`` (each registers its strategy)."""
    for info in pkgutil.iter_modules(rules.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{rules.__name__}.{info.name}")


_discover()
