"""The report at a glance (issue 30, item 7): one picture of strategy × regime, each cell's paired
reading against ``native`` with its Δ — what the comparison tables say, in one look.

One panel per metric of :data:`PANELS` that has a comparison: each workload's primary metric (final eval loss,
or −reward on rl) and lost gradient entries against fp32 (the underflow scaling exists to prevent). Rows:
strategies; columns: workload × precision below fp32. A cell's colour is its reading from
``comparisons.csv`` (:func:`analysis.paired.reading`) in three kinds — *clearly better* (green),
*clearly worse* (red), and everything else a **tie** at these seeds (grey: the too-few-seeds and
no-difference readings) — and its text the mean paired Δ (strategy − ``native`` per seed; lower
is better). ``native``'s own cells read "baseline"; a strategy that did not run there is blank.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from analysis.figures.common import REFERENCE_PRECISION, Figure, slug, subplots
from analysis.metrics import FINAL_PRIMARY, LOST_ENTRIES, Metric
from analysis.tables import BASELINE
from analysis.text import fmt
from analysis.words import (CLEARLY_BETTER, CLEARLY_WORSE, NO_DIFFERENCE, NOT_COMPARABLE, TIE,
                            TOO_FEW)

__all__ = ["KINDS", "PANELS", "kind_of", "overview_figure"]

PANELS: tuple[Metric, ...] = (FINAL_PRIMARY, LOST_ENTRIES)
#: The cell kinds, their colours and legend words: no run, baseline, better, tie, worse, n/a.
KINDS = (("", "#ffffff"), ("baseline", "#d9d9d9"), (CLEARLY_BETTER, "#7fc97f"),
         (TIE, "#f0f0f0"), (CLEARLY_WORSE, "#f08080"), (NOT_COMPARABLE, "#ffffff"))


def kind_of(reading: str) -> int:
    """The index in :data:`KINDS` of a paired ``reading``: clearly better / worse keep theirs,
    not comparable its own, every other reading is a tie at these seeds."""
    if reading in (CLEARLY_BETTER, CLEARLY_WORSE, NOT_COMPARABLE):
        return [k for k, _ in KINDS].index(reading)
    return 3


def _pct(v: float) -> str:
    """A fraction as a percentage to 3 significant digits (``0.000373%``, not ``0.00%``: a
    cell read clearly worse by a few entries in a million must not show zero)."""
    return "0%" if v == 0 else f"{100 * v:.3g}%"


def _grid(comps: pd.DataFrame, m: Metric, strategies: list[str], cols: list[tuple[str, str]]
          ) -> tuple[np.ndarray, list[list[str]]]:
    kinds = np.zeros((len(strategies), len(cols)), dtype=int)
    text = [[""] * len(cols) for _ in strategies]
    rows = comps[comps["metric"] == m.column].set_index(["strategy", "workload", "precision"])
    for i, s in enumerate(strategies):
        for j, (w, p) in enumerate(cols):
            if s == BASELINE:
                kinds[i, j], text[i][j] = 1, "baseline"
            elif (s, w, p) in rows.index:
                r = rows.loc[(s, w, p)]
                r = r.iloc[0] if isinstance(r, pd.DataFrame) else r
                kinds[i, j] = kind_of(str(r["reading"]))
                d = r["paired_diff"]
                text[i][j] = "–" if not np.isfinite(d) else _pct(d) if m.pct else fmt(d)
    return kinds, text


def overview_figure(comps: pd.DataFrame) -> Figure | None:
    """The figure (module docstring) from the comparisons against ``native``; ``None`` when
    there is none below fp32."""
    if comps.empty:
        return None
    c = comps[(comps["baseline"] == BASELINE) & (comps["precision"] != REFERENCE_PRECISION)]
    panels = [m for m in PANELS if (c["metric"] == m.column).any()]
    if c.empty or not panels:
        return None
    cols = sorted({(str(w), str(p)) for w, p in zip(c["workload"], c["precision"])})
    strategies = [BASELINE, *sorted(set(map(str, c["strategy"])) - {BASELINE})]
    width = 1.2 + 1.05 * len(cols)
    fig, axes = subplots(1, len(panels), figsize=(1.6 + width * len(panels),
                                                  1.9 + 0.32 * len(strategies)), sharey=True)
    cmap = ListedColormap([colour for _, colour in KINDS])
    for ax, m in zip(axes[0], panels):
        kinds, text = _grid(c, m, strategies, cols)
        ax.imshow(kinds, cmap=cmap, vmin=0, vmax=len(KINDS) - 1, aspect="auto")
        for i, row in enumerate(text):
            for j, t in enumerate(row):
                ax.text(j, i, t, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(cols)), [f"{w.rsplit('/', 1)[-1]}\n{p}" for w, p in cols],
                      fontsize=7)
        ax.set_yticks(range(len(strategies)), strategies, fontsize=7)
        ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(len(strategies) + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", lw=1.5)
        ax.grid(which="major", visible=False)
        ax.tick_params(which="minor", length=0)
        ax.set_title(f"{m.label}: Δ vs {BASELINE}", fontsize=9)
    handles = [Patch(facecolor=colour, edgecolor="0.6", label=word)
               for word, colour in KINDS[1:5]]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"At a glance: every strategy against {BASELINE}, paired by seed")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return Figure(slug("overview"), "At a glance", (
        f"Each cell: the strategy's paired reading against `{BASELINE}` in that workload × "
        f"precision (comparisons.csv) — green {CLEARLY_BETTER}, red {CLEARLY_WORSE}, grey a "
        f"{TIE} at these seeds ({TOO_FEW}, or {NO_DIFFERENCE}) — and its mean Δ "
        f"per seed (strategy − `{BASELINE}`; lower is better). Panels: "
        + ", ".join(m.label for m in panels) + "."), fig)
