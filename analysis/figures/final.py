"""Final-metric intervals per strategy (rliable's interval-estimate plot) and strategy overhead
against model size from ``scalelab-bench``."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.figures.common import Figure, finish, palette, subplots
from analysis.metrics import METRICS, STRATEGY_OVERHEAD, Metric
from analysis.tables import identified

__all__ = ["interval_figures", "overhead_figures"]


def interval_figures(summary: pd.DataFrame, metrics: Sequence[Metric] = METRICS) -> list[Figure]:
    """Per workload: one panel per metric, each strategy × precision's mean (dot) with its 95 %
    bootstrap interval (bar) and IQM (open diamond) — rliable's interval-estimate plot."""
    summary = identified(summary)  # a group of unknown precision or strategy has no colour or label
    if summary.empty:
        return []
    out = []
    for workload in sorted(summary["workload"].dropna().unique()):
        cell = summary[summary["workload"] == workload].sort_values(["precision", "strategy"])
        present = [m for m in metrics if f"{m.column}_mean" in cell
                   and cell[f"{m.column}_mean"].notna().any()]
        if not present:
            continue
        labels = (cell["strategy"] + " · " + cell["precision"]).tolist()
        y = np.arange(len(labels))
        pal = palette(cell["precision"])
        fig, axes = subplots(1, len(present), figsize=(3.6 * len(present),
                                                           0.9 + 0.35 * len(labels)),
                             squeeze=False, sharey=True)
        for ax, m in zip(axes[0], present):
            c = m.column
            mean = cell[f"{c}_mean"].to_numpy(dtype=float)
            lo = cell[f"{c}_mean_lo"].to_numpy(dtype=float)
            hi = cell[f"{c}_mean_hi"].to_numpy(dtype=float)
            colours = [pal[p] for p in cell["precision"]]
            for yi, mu, a, b, col, q in zip(y, mean, lo, hi, colours, cell[f"{c}_iqm"]):
                if not math.isfinite(mu):
                    continue
                if math.isfinite(a) and math.isfinite(b):
                    ax.plot([a, b], [yi, yi], color=col, lw=4, alpha=0.45, solid_capstyle="butt")
                if math.isfinite(q):
                    ax.plot([q], [yi], "D", mfc="none", mec="black", ms=7, mew=0.8, zorder=3)
                ax.plot([mu], [yi], "o", color=col, ms=4, zorder=4)
            ax.set_title(m.label, fontsize=9)
            ax.set_yticks(y, labels)
        axes[0][0].invert_yaxis()  # shared y: inverting once flips every panel
        out.append(finish(
            fig, "intervals", "Final metrics", (workload,),
            "Dot: mean over seeds; bar: 95 % percentile-bootstrap interval of the mean; open "
            "diamond: interquartile mean. Lower is better in every panel. Overlapping bars mean "
            "the seeds cannot tell the strategies apart."))
    return out


def overhead_figures(bench: pd.DataFrame | None) -> list[Figure]:
    """Strategy overhead against model size from ``scalelab-bench``
    (:func:`analysis.bench.load_bench`): left, median per-step time of scale + unscale_ + step +
    update (log-log); right, the same as a ratio to ``torch.amp.GradScaler`` at each size."""
    if bench is None or bench.empty:
        return []
    pal = palette(bench["name"])
    has_ratio = bench["ratio_vs_gradscaler"].notna().any()
    fig, axes = subplots(1, 2 if has_ratio else 1, figsize=(11 if has_ratio else 6, 3.8),
                             squeeze=False)
    sns.lineplot(data=bench, x="size", y="median_ms", hue="name", palette=pal, marker="o",
                 errorbar=None, ax=axes[0][0])
    axes[0][0].set(xscale="log", yscale="log", xlabel="parameters",
                   ylabel="median ms per step (strategy only)")
    if has_ratio:
        sns.lineplot(data=bench.dropna(subset=["ratio_vs_gradscaler"]), x="size",
                     y="ratio_vs_gradscaler", hue="name", palette=pal, marker="o",
                     errorbar=None, ax=axes[0][1], legend=False)
        axes[0][1].axhline(1.0, color="black", lw=0.8, ls="--")
        axes[0][1].set(xscale="log", xlabel="parameters", ylabel="time / GradScaler time")
    title = f"{STRATEGY_OVERHEAD.label.capitalize()} vs model size"
    fig.suptitle(f"{title} (scalelab-bench)")
    fig.tight_layout()
    return [Figure("overhead_vs_size", title,
                   "From `scalelab-bench`: median time per step of scale + unscale_ + step + "
                   "update with a no-op optimizer (forward/backward excluded), every "
                   "configuration measured side by side in one process; right, relative to "
                   "torch.amp.GradScaler at the same size (dashed line = parity). norm_ratio is "
                   "measured without its fp32 probe, whose cost the training runs record.", fig)]
