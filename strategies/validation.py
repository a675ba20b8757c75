"""Constructor validation shared by every strategy: one clear ``ValueError`` per bad field.

Messages follow one shape so that a user (or a Hydra override) sees the field, the allowed range
and the value it got, e.g. ``growth_factor must be > 1, got 0.5``.
"""

from __future__ import annotations

import math
from typing import Any


def fail(field: str, allowed: str, value: Any) -> None:
    raise ValueError(f"{field} must be {allowed}, got {value!r}")


def _real(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(field, "a real number", value)
    return float(value)


def finite_positive(field: str, value: Any) -> float:
    v = _real(field, value)
    if not (math.isfinite(v) and v > 0):
        fail(field, "finite and > 0", value)
    return v


def greater_than(field: str, value: Any, bound: float) -> float:
    v = _real(field, value)
    if not (math.isfinite(v) and v > bound):
        fail(field, f"> {bound:g}", value)
    return v


def open_interval(field: str, value: Any, lo: float, hi: float) -> float:
    v = _real(field, value)
    if not (lo < v < hi):
        fail(field, f"in ({lo:g}, {hi:g})", value)
    return v


def half_open_interval(field: str, value: Any, lo: float, hi: float) -> float:
    """``lo <= value < hi``."""
    v = _real(field, value)
    if not (lo <= v < hi):
        fail(field, f"in [{lo:g}, {hi:g})", value)
    return v


def int_at_least(field: str, value: Any, bound: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not (
        isinstance(value, float) and value.is_integer()
    ):
        fail(field, f"an integer >= {bound}", value)
    v = int(value)
    if v < bound:
        fail(field, f"an integer >= {bound}", value)
    return v


def boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        fail(field, "a bool", value)
    return value


def one_of(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        fail(field, "one of " + ", ".join(repr(c) for c in choices), value)
    return value
