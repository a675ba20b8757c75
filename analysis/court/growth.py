"""Growth and backoff events of a run's loss scale, read from its ``trace.jsonl`` (issue 30).

The trace holds the scale every step ran at (``experiments.schema.TRACE_COLUMNS``: column
``scale.0`` of a one-scale strategy; the chunk rows are little-endian float32, row-major, base64,
as the schema says). With ``s_t`` the scale of step ``t``, a **growth** is a step with
``s_{t+1} > s_t`` and a **backoff** one with ``s_{t+1} < s_t`` (torch's GradScaler: ``update()``
multiplies by ``growth_factor`` after ``growth_interval`` clean steps and by ``backoff_factor`` on
an overflow). A **growth after a backoff** is a growth at a step later than the run's first
backoff: the proof that a rule's growth interval acted after it had to back off.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from experiments.schema import KIND_TRACE, SUMMARY_NAME, TRACE_COLUMNS, TRACE_NAME

__all__ = ["Events", "events", "growth_interval", "trace_scales"]

_SCALE = list(TRACE_COLUMNS).index("scale.<i>")  # the first scale column of a row


def trace_scales(run_dir: str | Path) -> list[float]:
    """The scale of every traced step of the run in ``run_dir``, in step order (first scale group;
    empty when the run has no readable trace)."""
    path = Path(run_dir) / TRACE_NAME
    if not path.is_file():
        return []
    rows: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            chunk = json.loads(line)
            if chunk.get("kind") != KIND_TRACE:
                continue
            n, width, step = int(chunk["n"]), int(chunk["width"]), int(chunk["step"])
            flat = struct.unpack(f"<{n * width}f", base64.b64decode(chunk["data"], validate=True))
        except (ValueError, KeyError, TypeError, AttributeError, struct.error):
            continue  # a cut or hostile line: the steps it held are missing
        for i in range(n):
            rows[step + i] = flat[i * width + _SCALE]
    return [rows[k] for k in sorted(rows)]


@dataclass(frozen=True)
class Events:
    """A run's scale events: ``growths``, ``backoffs``, ``first_backoff`` (the step index after
    which the scale first fell, or ``None``) and ``growths_after_backoff``, with the first such
    growth's step index ``first_regrowth``."""

    growths: int
    backoffs: int
    first_backoff: int | None
    growths_after_backoff: int
    first_regrowth: int | None


def events(scales: Sequence[float]) -> Events:
    """The :class:`Events` of a scale trajectory (module docstring). Step indices are 1-based:
    an event at index ``t`` changed the scale between step ``t`` and step ``t + 1``."""
    ups = [t for t in range(1, len(scales)) if scales[t] > scales[t - 1]]
    downs = [t for t in range(1, len(scales)) if scales[t] < scales[t - 1]]
    first = downs[0] if downs else None
    after = [t for t in ups if first is not None and t > first]
    return Events(len(ups), len(downs), first, len(after), after[0] if after else None)


def growth_interval(run_dir: str | Path) -> Any:
    """The run's ``strategy.growth_interval`` from its summary's resolved config, or ``None``."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_NAME).read_text(encoding="utf-8"))
        value = summary["fingerprint"]["config"]["strategy"].get("growth_interval")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
