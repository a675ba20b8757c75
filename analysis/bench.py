"""Read the JSON written by ``scalelab-bench`` into a small table for the overhead figure.

The benchmark's format belongs to ``experiments/bench.py``; this reader is deliberately
tolerant: it looks for a list of records (the file itself, or its ``results``/``records``/
``rows``/``runs`` list) where each record names a strategy, a model size and an overhead.
Recognised keys, first match wins:

* strategy: ``strategy``, ``name``
* size: ``n_params``, ``params``, ``num_params``, ``model_params``, ``numel``, ``size``
* overhead: ``overhead_frac``, ``strategy_overhead_frac``, ``overhead_ratio``, ``ratio``,
  ``overhead``, ``strategy_overhead_s``, ``overhead_s``
* optional series split: ``device``, ``precision``

A file that is absent, unreadable or has none of this yields ``None`` and a one-line note
(the report then says the figure was skipped and why) — never an exception.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

STRATEGY_KEYS = ("strategy", "name")
SIZE_KEYS = ("n_params", "params", "num_params", "model_params", "numel", "size")
OVERHEAD_KEYS = ("overhead_frac", "strategy_overhead_frac", "overhead_ratio", "ratio",
                 "overhead", "strategy_overhead_s", "overhead_s")
LIST_KEYS = ("results", "records", "rows", "runs")


def _records(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, list):
        return [r for r in obj if isinstance(r, dict)]
    if isinstance(obj, dict):
        for key in LIST_KEYS:
            if isinstance(obj.get(key), list):
                return [r for r in obj[key] if isinstance(r, dict)]
    return []


def _first(rec: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in rec and rec[k] is not None:
            return k, rec[k]
    return None, None


def load_bench(path: str | Path | None) -> tuple[pd.DataFrame | None, str | None]:
    """``(table, note)``: the table has ``strategy``, ``size``, ``overhead``, ``series``,
    ``size_label``, ``overhead_label`` columns; ``note`` says why there is no table."""
    if path is None:
        return None, "no benchmark JSON given (--bench); overhead-vs-size figure skipped"
    p = Path(path)
    if not p.is_file():
        return None, f"benchmark JSON not found: {p}; overhead-vs-size figure skipped"
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"benchmark JSON unreadable ({exc}); overhead-vs-size figure skipped"
    rows = []
    for rec in _records(obj):
        _, strategy = _first(rec, STRATEGY_KEYS)
        size_key, size = _first(rec, SIZE_KEYS)
        ov_key, overhead = _first(rec, OVERHEAD_KEYS)
        if strategy is None or not isinstance(size, (int, float)) \
                or not isinstance(overhead, (int, float)):
            continue
        extra = [str(rec[k]) for k in ("device", "precision") if rec.get(k) is not None]
        rows.append({"strategy": str(strategy), "size": float(size), "overhead": float(overhead),
                     "series": " · ".join([str(strategy), *extra]), "size_label": size_key,
                     "overhead_label": ov_key})
    if not rows:
        return None, (f"benchmark JSON {p} has no records with a strategy, a model size and an "
                      "overhead; overhead-vs-size figure skipped")
    return pd.DataFrame(rows), None
