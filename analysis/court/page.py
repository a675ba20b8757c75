"""``docs/court.md``: the fp16-RL scaler court's page, written from its runs (issue 30).

``python -m analysis.court RUN_DIR --page docs/court.md [--quick]`` (``make court`` runs the sweeps
of ``conf/experiment/court*.yaml`` into ``runs/court``, ``QUICK=1`` into ``runs/court_quick``, then
this) loads the runs (:func:`analysis.load.load_runs`) and writes, per court workload (``rl``, then
``finetune``), the recommendation or tie (:func:`analysis.court.readings.recommend`) and one table
row per cell (:func:`analysis.court.readings.court_rows`), then the cells that are inconclusive
against GradScaler and the cells with no runs. Every number comes from the runs; the page names
the command that wrote it and carries no clock, so a page rebuilt from the same runs is identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis.court.readings import (BASE_CELL, COURT_CELLS, REF_CELL, WORKLOADS, Primary,
                                     court_cells, court_rows, format_row, is_inconclusive,
                                     primary_for, recommend)
from analysis.document import Document, write_document
from analysis.load import RunLoadError, load_runs
from analysis.metrics import LOST_ENTRIES, SKIPPED_STEPS
from analysis.records import STATUSES
from analysis.text import code
from analysis.words import CLEARLY_BETTER, CLEARLY_WORSE, INCONCLUSIVE

__all__ = ["court_page", "main", "workload_section", "write_court"]

_WHAT = {"rl": "GRPO fine-tuning of the pretrained character GPT, rollouts sampled in fp16 "
               "(`+experiment=court_rl`)",
         "finetune": "the pretrained character GPT fine-tuned at lr 1e-4 on held-out text "
                     "(`+experiment=court_finetune`)"}


def _counts(runs: pd.DataFrame) -> str:
    n = runs["status"].value_counts()
    words = [*STATUSES, *sorted(set(n.index) - set(STATUSES))]
    return ", ".join(f"{int(n.get(s, 0))} {s}" for s in words if int(n.get(s, 0)))


def _size(runs: pd.DataFrame) -> str:
    """``k seeds, n steps`` of the runs (the most seeds of a cell, the longest completed run)."""
    if runs.empty or "seed" not in runs:
        return "no runs"
    seeds = runs["seed"].dropna().nunique()
    done = runs.loc[runs["status"] == "completed", "steps"] if "steps" in runs else []
    steps = pd.to_numeric(pd.Series(done), errors="coerce").max()
    return f"{seeds} seeds, {int(steps) if pd.notna(steps) else '?'} steps"


def _columns(p: Primary) -> list[str]:
    better = "higher" if p.higher else "lower"
    return ["cell", "survived: P(run survives) [95% CI]", f"{p.label} ({better} is better), "
            "mean [95% CI]", f"Δ {p.label} vs GradScaler (`{BASE_CELL}`)",
            f"Δ {p.label} vs `{REF_CELL}`", f"Δ {LOST_ENTRIES.label} vs GradScaler (fraction)",
            f"{SKIPPED_STEPS.label} per run", "reading vs GradScaler"]


def workload_section(doc: Document, runs: pd.DataFrame, workload: str, quick: bool = False,
                     missing_words: str = "", what: str = "") -> None:
    """The heading, the call, the table and the inconclusive / missing cells of one workload
    (``quick``: the missing cells are those the QUICK pass leaves to the full court;
    ``missing_words``: how another page names the cells it does not run; ``what``: its heading's
    description of the runs, for another page's experiment)."""
    p = primary_for(runs, workload)
    doc.h(1, f"`{workload}`: {what or _WHAT[workload]}")
    cells = court_cells(runs, workload)
    if not cells:
        doc.p(f"No runs of `{workload}` under the directory: run `make court` (every cell of "
              f"this workload is missing).")
        return
    wl = runs[runs["regime"] == workload]
    seeds = sorted(int(s) for s in wl["seed"].dropna().unique())
    steps = pd.to_numeric(wl.loc[wl["status"] == "completed", "steps"], errors="coerce").max()
    doc.p(f"{len(wl)} runs ({_counts(wl)}); seeds {', '.join(map(str, seeds))}; "
          f"{int(steps) if pd.notna(steps) else '?'} steps per completed run.")
    v = recommend(cells, p)
    doc.p(f"**fp16 setting for `{workload}`:** {v.text}.")
    df = court_rows(cells, p)
    records = df.to_dict("records")
    doc.table(_columns(p), [format_row(r, p) for r in records if r.get("n")], caption=(  # missing: listed below
        "Δ = cell − baseline per seed (paired: seeds share init, data and rollouts), mean "
        "[95% BCa bootstrap CI]; a run that did not survive loses its seed (left out of the "
        "mean Δ). P(run survives): completed / ended runs with its Clopper–Pearson interval. "
        "Reading: analysis/paired.py's rule (paired t, Holm over this table, and Wilcoxon)."))
    fp16 = [r for r in records if r.get("n") and r["cell"] not in (BASE_CELL, REF_CELL, "bf16")]
    vague = [r["cell"] for r in fp16 if is_inconclusive(r)]
    if vague:
        doc.p(f"{INCONCLUSIVE.capitalize()} against GradScaler on {p.label} (neither "
              f"{CLEARLY_BETTER} nor {CLEARLY_WORSE} with these seeds): "
              f"{', '.join(code(c) for c in vague)}.")
    missing = [r["cell"] for r in records if not r.get("n")]
    if missing:
        lead = missing_words or ("Not run in the QUICK pass (the full court only, `make court`)"
                                 if quick else "No runs")
        doc.p(f"{lead}: {', '.join(code(c) for c in missing)}.")


def court_page(runs: pd.DataFrame, command: str, quick: bool) -> Document:
    """The page (module docstring) for the runs table ``runs``."""
    doc = Document("The fp16-RL scaler court")
    doc.p(f"<!-- Generated by `{command}`; do not edit by hand: run it again. -->")
    shas = sorted({str(s)[:12] for s in runs.get("git_sha", pd.Series(dtype=object)).dropna()})
    doc.p((f"**QUICK pass** (`make court QUICK=1`: {_size(runs)}, and only the cells whose rules "
           "can act within that horizon, each workload's missing cells listed under its table; "
           f"with so few seeds most cells are {INCONCLUSIVE} — the full court is `make court`). "
           if quick else f"**Full court** (`make court`: {_size(runs)}). ")
          + f"{len(runs)} runs ({_counts(runs)}) at commit "
          f"{', '.join(code(s) for s in shas) or '(unknown)'}. Which fp16 loss-scaling setting "
          "to use for RL fine-tuning: every shipped preset and folk remedy "
          f"({', '.join(code(c) for c in COURT_CELLS)}) on the same seeds; the cells, horizon "
          "and commands are in `conf/experiment/court.yaml`, the runs in `docs/sweeps.md`.")
    doc.p("A setting is recommended only where, paired by seed, its interval separates it from "
          "every other fp16 cell; otherwise the page says **tie** and names the cells the runs "
          "cannot tell apart. bf16 and fp32 are shown for scale, not ranked.")
    for workload in WORKLOADS:
        workload_section(doc, runs, workload, quick)
    return doc


def write_court(run_dirs: Sequence[str | Path], page: str | Path, *, quick: bool,
                command: str) -> Path:
    """Load ``run_dirs`` and write the page to ``page``; raises
    :class:`analysis.load.RunLoadError` for a missing or empty directory."""
    rs = load_runs(list(run_dirs))
    return write_document(court_page(rs.runs, command, quick), page)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m analysis.court``: write the court's page; exit 2 on a missing directory."""
    parser = argparse.ArgumentParser(prog="python -m analysis.court",
                                     description="Write docs/court.md from the court's runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--page", default="docs/court.md", help="where (default docs/court.md)")
    parser.add_argument("--quick", action="store_true", help="label the page as the QUICK pass")
    args = parser.parse_args(argv)
    command = " ".join(["python -m analysis.court", *args.run_dirs, "--page", args.page]
                       + (["--quick"] if args.quick else []))
    try:
        path = write_court(args.run_dirs, args.page, quick=args.quick, command=command)
    except RunLoadError as exc:
        print(f"python -m analysis.court: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
