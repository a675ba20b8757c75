"""Read the JSON written by ``scalelab-bench`` (``experiments/bench/cli.py``) for the report.

The file is ``{"meta": {...}, "overhead": [row, ...], "stats_pass": [...]}`` where each overhead
row is one configuration at one size, measured side by side in one process::

    {"size": <parameters>, "tensors": int, "name": "<strategy>" | "GradScaler" | "none",
     "median_ms": <median per-step scale+unscale_+step+update time>,
     "ratio_vs_gradscaler": <median_ms / GradScaler's median_ms at that size> | null, ...}

:func:`load_bench` returns those rows as a table (columns ``name``, ``size``, ``median_ms``,
``ratio_vs_gradscaler``). A file that is absent, unreadable or has no overhead rows yields
``None`` and a one-line note saying why (the report then skips the figure) — never an exception.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["COLUMNS", "load_bench"]

COLUMNS = ("name", "size", "tensors", "median_ms", "ratio_vs_gradscaler")


def load_bench(path: str | Path | None) -> tuple[pd.DataFrame | None, str | None]:
    """``(table, note)`` — the overhead rows of a ``scalelab-bench`` JSON, or ``None`` and the
    reason there are none."""
    if path is None:
        return None, ("no benchmark JSON given (`--bench`); the overhead-vs-size figure is "
                      "skipped — run `scalelab-bench` and pass its JSON")
    p = Path(path)
    if not p.is_file():
        return None, f"benchmark JSON not found: `{p}`; the overhead-vs-size figure is skipped"
    try:
        obj: Any = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"benchmark JSON `{p}` unreadable ({exc}); the overhead-vs-size figure is skipped"
    rows = obj.get("overhead") if isinstance(obj, dict) else None
    good = [
        {c: r.get(c) for c in COLUMNS}
        for r in (rows if isinstance(rows, list) else [])
        if isinstance(r, dict) and isinstance(r.get("name"), str)
        and isinstance(r.get("size"), (int, float)) and isinstance(r.get("median_ms"), (int, float))
    ]
    if not good:
        return None, (f"benchmark JSON `{p}` has no `overhead` rows with name, size and "
                      "median_ms; the overhead-vs-size figure is skipped")
    df = pd.DataFrame(good)
    df["ratio_vs_gradscaler"] = pd.to_numeric(df["ratio_vs_gradscaler"], errors="coerce")
    return df.sort_values(["name", "size"]).reset_index(drop=True), None
