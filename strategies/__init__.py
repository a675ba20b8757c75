"""scalelab strategies: drop-in replacements for ``torch.amp.GradScaler``.

>>> import strategies
>>> scaler = strategies.create("native")        # exactly torch's GradScaler rule
>>> strategies.available()                       # every registered strategy

Every module of ``strategies/rules/`` is imported here, so a strategy added as one new file that uses
``@register_strategy`` is discovered with no other edit. Other installed packages can add
strategies through the ``scalelab.strategies`` entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil

from strategies import rules
from strategies.base import Strategy
from strategies.registry import (
    UnknownStrategyError,
    available,
    create,
    get,
    load_plugins,
    register_strategy,
)
from strategies.stats import GradStats, unscale_and_stats

__all__ = [
    "GradStats",
    "Strategy",
    "UnknownStrategyError",
    "available",
    "create",
    "get",
    "register_strategy",
    "unscale_and_stats",
]


def _discover() -> None:
    for info in pkgutil.iter_modules(rules.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{rules.__name__}.{info.name}")
    load_plugins()


_discover()
