"""Constructor validation shared by every strategy: one clear ``ValueError`` per bad field.

Messages follow one shape so that a user (or a Hydra override) sees the field, the allowed range
and the value it got, e.g. ``growth_factor must be > 1, got 0.5``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = [
    "Check", "above", "between", "boolean", "choice", "device", "fail", "finite_positive", "greater_than",
    "half_open_interval", "int_at_least", "integer", "one_of", "open_interval", "optional", "patterns",
]


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


# ---------------------------------------------------------------------------------------------
# Check factories for hyper-parameter declarations (strategies/params.py): each returns a
# ``check(field, value) -> normalised value`` that raises the one-line ValueError above.
# ---------------------------------------------------------------------------------------------
Check = Callable[[str, Any], Any]


def above(bound: float) -> Check:
    return lambda field, value: greater_than(field, value, bound)


def between(lo: float, hi: float, closed: str = "()") -> Check:
    """``lo < value < hi`` (``"()"``), ``lo <= value < hi`` (``"[)"``) or ``lo <= value <= hi`` (``"[]"``)."""
    if closed == "()":
        return lambda field, value: open_interval(field, value, lo, hi)
    if closed == "[)":
        return lambda field, value: half_open_interval(field, value, lo, hi)

    def closed_interval(field: str, value: Any) -> float:
        x = _real(field, value)
        if not (lo <= x <= hi):
            fail(field, f"in [{lo:g}, {hi:g}]", value)
        return x

    return closed_interval


def integer(at_least: int) -> Check:
    return lambda field, value: int_at_least(field, value, at_least)


def choice(*choices: str) -> Check:
    return lambda field, value: one_of(field, value, choices)


def optional(check: Check) -> Check:
    """``None`` or what ``check`` accepts."""
    return lambda field, value: None if value is None else check(field, value)


def patterns(field: str, value: Any) -> list[str] | None:
    """``None`` or a non-empty list of fnmatch patterns (strings)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        fail(field, "a list of fnmatch patterns (strings) or None", value)
    if not value:
        fail(field, "a non-empty list or None", value)
    return list(value)


def device(field: str, value: Any) -> str | None:
    """``None`` or a device string torch understands (``"cpu"``, ``"cuda"``, ``"cuda:1"``)."""
    if value is None:
        return None
    try:
        return str(torch.device(value))
    except (RuntimeError, TypeError):
        fail(field, "a torch device such as 'cpu', 'cuda' or 'cuda:0', or None", value)
    raise AssertionError  # unreachable
