"""The report's replay table: for each failed or stalled run, what every preset would have done on
its trace — read from the ``replay.json`` the experiments side wrote into the run directory
(``scalelab-replay SWEEP_DIR --table``; fields: ``experiments.schema.REPLAY_FIELDS``). The replay
itself runs torch code, so it is not computed here: analysis reads run records only.

:func:`read_replays` gives one row per (run, preset), every value coerced through the schema;
:func:`replay_section` writes the section (one table per run, the worst runs first: diverged,
stalled or failed, then by share of skipped steps), and the report writes the rows as ``replay.csv``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd

from experiments.schema import REPLAY_FIELDS, REPLAY_NAME, REPLAY_ROW_FIELDS

from analysis.document import Document
from analysis.load import MiB, read_object
from analysis.metrics import SKIPPED_STEPS
from analysis.records import coerce_fields, cut, describe_bad
from analysis.text import code, fmt

__all__ = ["COLUMNS", "MAX_REPLAY_BYTES", "MAX_TABLES", "read_replays", "replay_section"]

MAX_REPLAY_BYTES = 1 * MiB
"""Largest ``replay.json`` read (a real one is a few kB: one row per preset)."""

MAX_TABLES = 12
"""Runs shown in the report, worst first; every run is in ``replay.csv``."""

RUN_KEYS = ("why", "recorded", "steps", "skipped", "final_scale")
COLUMNS = ("run_id", "status", *(f"run_{k}" for k in RUN_KEYS), *REPLAY_ROW_FIELDS)
"""``replay.csv``'s columns: the run, why it counts as failed, its recorded numbers, then one preset's."""


def _rows(run_id: str, status: str, raw: dict, problems: list[str], where: str) -> list[dict]:
    bad: Counter = Counter()
    top = coerce_fields(REPLAY_FIELDS, raw, bad)
    out = []
    for item in top.get("presets") or []:
        row = coerce_fields(REPLAY_ROW_FIELDS, item if isinstance(item, dict) else {}, bad)
        if row.get("strategy") is None:
            bad["presets"] += 1
            continue
        for key in ("strategy", "stopped", "unreplayable"):
            if row.get(key) is not None:
                row[key] = cut(row[key], 300)
        out.append({"run_id": run_id, "status": status,
                    **{f"run_{k}": top.get(k) for k in RUN_KEYS}, **row})
    if bad:
        problems.append(describe_bad(where, bad))
    return out


def read_replays(runs: pd.DataFrame, problems: list[str]) -> pd.DataFrame:
    """One row per (run, preset) of every ``replay.json`` in the runs' directories (:data:`COLUMNS`);
    an unreadable or bad file is one line of ``problems``."""
    rows: list[dict] = []
    for _, r in runs.iterrows():
        if not isinstance(r.get("run_dir"), str):
            continue
        path = Path(r["run_dir"]) / REPLAY_NAME
        raw = read_object(path, MAX_REPLAY_BYTES, "replay", "no replay shown", problems)
        if raw is not None:
            rows += _rows(r["run_id"], r["status"], raw, problems, str(path))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _severity(g: pd.DataFrame) -> tuple[int, float]:
    first = g.iloc[0]
    failed = first["status"] in ("diverged", "failed")
    share = (first["run_skipped"] or 0) / max(first["run_steps"] or 1, 1)
    return (0 if failed else 1, -share)


def _cells(p: pd.Series) -> list[str]:
    if isinstance(p["unreplayable"], str):
        why = "needs the fp32 probe" if "fp32" in p["unreplayable"] else p["unreplayable"]
        return [code(p["strategy"]), code(why, max_chars=120), "–", "–", "–"]
    lowest = "–" if pd.isna(p["min_scale"]) else f"{fmt(p['min_scale'])} (step {int(p['min_scale_step'])})"
    floor = ("no floor" if pd.isna(p["floor"]) else f"{int(p['floor_steps'])} at {fmt(p['floor'])}")
    final = fmt(p["final_scale"]) + ("; stops at its floor" if isinstance(p["stopped"], str) else "")
    return [code(p["strategy"]), f"{int(p['skipped'])} of {int(p['steps'])}", lowest, floor, final]


def replay_section(doc: Document, table: pd.DataFrame) -> None:
    """The report's section "Replays of failed and stalled runs" (module docstring); nothing when
    no run has a ``replay.json``."""
    if table.empty:
        return
    doc.h(1, "Replays of failed and stalled runs")
    groups = sorted(table.groupby("run_id", sort=False), key=lambda kv: _severity(kv[1]))
    doc.p(f"{len(groups)} runs failed or stalled (diverged, stalled or failed; at their strategy's "
          "min scale; or skipping at least 10% of their steps). For each, every preset replayed on "
          "the run's recorded statistics trace (scalelab-replay RUN_DIR --table; docs/replay.md "
          "says how far a replay is to be trusted: up to the first step where its skips differ from "
          "the run's, the gradients are the recorded ones)." +
          (f" The {MAX_TABLES} worst are shown; every run is in replay.csv." if len(groups) > MAX_TABLES else ""))
    for run_id, g in groups[:MAX_TABLES]:
        first = g.iloc[0]
        doc.h(2, code(run_id))
        doc.table(["preset", SKIPPED_STEPS.label, "lowest scale", "steps at its floor", "final scale"],
                  [_cells(p) for _, p in g.iterrows()],
                  caption=(f"Recorded ({code(first['run_recorded'])}): {code(first['run_why'], max_chars=200)}; "
                           f"{fmt(first['run_skipped'])} of {fmt(first['run_steps'])} steps skipped, final scale "
                           f"{fmt(first['run_final_scale'])}."))
