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
    "whole", "number", "at_least", "flag", "named",
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


# ---------------------------------------------------------------------------------------------
# Checks in a config file's words, for options set in YAML or on the command line (the app's run
# options in experiments/app/config.py, the workloads' model and data options): YAML's
# true/false, bare choice names, "a number in [lo, hi]", integers below 2^31.
# ---------------------------------------------------------------------------------------------
INT_LIMIT = 2**31
"""Upper bound (exclusive) of an integer option: larger values are typos or attacks."""


def whole(at_least: int, at_most: int | None = None) -> Check:
    """An ``int`` (a bool or a float is refused) in ``[at_least, at_most]``, or ``>= at_least`` and
    below 2^31: ``train.steps must be an integer >= 1, got 0``."""
    allowed = f"an integer >= {at_least}" if at_most is None else f"an integer in [{at_least}, {at_most}]"

    def check(field: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < at_least or (
                at_most is not None and value > at_most):
            fail(field, allowed, value)
        if value >= INT_LIMIT:
            fail(field, "an integer below 2^31", value)
        return value

    return check


def number(lo: float, hi: float, closed: str = "[]") -> Check:
    """A real number (not a bool, not NaN) in ``[lo, hi]``, or ``(lo, hi]`` with ``closed="(]"``,
    returned as a float: ``regime.loss_multiplier must be a number in [1e-12, 1e+06], got 0``."""
    allowed = f"a number in {closed[0]}{lo:g}, {hi:g}]"

    def check(field: str, value: Any) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok and (value > lo if closed[0] == "(" else value >= lo) and value <= hi):
            fail(field, allowed, value)
        return float(value)

    return check


def at_least(bound: float) -> Check:
    """A finite real number ``>= bound`` (its value unchanged): ``model.ffn_gain must be >= 1e-12, got 0.0``."""

    def check(field: str, value: Any) -> Any:
        v = _real(field, value)
        if not (math.isfinite(v) and v >= bound):
            fail(field, f">= {bound:g}", value)
        return value

    return check


def flag(field: str, value: Any) -> bool:
    """``true`` or ``false`` (YAML's words for a bool): ``train.resume must be true or false, got 'maybe'``."""
    if not isinstance(value, bool):
        fail(field, "true or false", value)
    return value


def named(*choices: str) -> Check:
    """One of ``choices``, named bare as in YAML: ``train.lr_decay must be one of cosine, constant, got 'linear'``."""
    allowed = "one of " + ", ".join(choices)

    def check(field: str, value: Any) -> str:
        if value not in choices:
            fail(field, allowed, value)
        return value

    return check
