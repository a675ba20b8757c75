"""One range check for the options the model and data constructors take."""

from __future__ import annotations

import math

__all__ = ["check_option"]


def check_option(group: str, name: str, value: object, low: float, high: float | None = None) -> None:
    """Raise ``ValueError`` naming ``group.name`` unless ``value`` lies in ``[low, high]``.

    An integer ``low`` asks for an integer (``bool`` is not one); a float ``low`` for a finite number.
    """
    integer = isinstance(low, int)
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if ok and not integer:
        ok = math.isfinite(value)  # type: ignore[arg-type]
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{group}.{name} must be {kind} {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):  # type: ignore[operator]
        raise ValueError(f"{group}.{name} must be {allowed}, got {value}")
