"""Paired differences per seed: where people would rather look than read the paired table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.figures.common import REFERENCE_PRECISION, Figure, cells, finish, palette, subplots
from analysis.metrics import PRIMARY, label
from analysis.tables import BASELINE, identified

__all__ = ["paired_difference_figures"]


def paired_difference_figures(runs: pd.DataFrame, metric: str = PRIMARY) -> list[Figure]:
    """Per workload × reduced precision with ``native``: each strategy's ``metric`` minus
    ``native``'s of the same seed, one dot per seed (a little jitter so that equal ones show),
    a black bar at each strategy's mean difference, the zero line dashed (completed runs with
    finite values only). No line joins a seed's dots across strategies: the strategies are
    categories, not a sequence, and such a line reads as a trend (issue 30)."""
    runs = identified(runs)
    if runs.empty or metric not in runs:
        return []
    done = runs[runs["status"] == "completed"].assign(
        value=lambda d: pd.to_numeric(d[metric], errors="coerce"))
    done = done[np.isfinite(done["value"])]
    out = []
    # Only cells where native ran (a control cell such as bf16 `none` has nothing to pair with).
    with_native = done.groupby(["workload", "precision"])["strategy"].transform(
        lambda s: (s == BASELINE).any())
    for workload, prec in cells(done[(done["precision"] != REFERENCE_PRECISION) & with_native]):
        cur = done[(done["workload"] == workload) & (done["precision"] == prec)]
        wide = cur.pivot_table(index="seed", columns="strategy", values="value", aggfunc="mean")
        if BASELINE not in wide or wide.shape[1] < 2:
            continue
        with np.errstate(all="ignore"):
            diff = wide.drop(columns=BASELINE).sub(wide[BASELINE], axis=0)
        order = sorted(diff.columns, key=str)
        long = (diff.reset_index().melt(id_vars="seed", var_name="strategy", value_name="diff")
                .dropna())
        long = long[np.isfinite(long["diff"])]
        if long.empty:
            continue
        fig, axes = subplots(1, 1, figsize=(2.5 + 1.1 * len(order), 3.6))
        ax = axes[0][0]
        sns.stripplot(data=long, x="strategy", y="diff", hue="strategy", order=order,
                      palette=palette(wide.columns), jitter=0.12, size=5, legend=False, ax=ax,
                      zorder=2)
        means = long.groupby("strategy")["diff"].mean()
        for i, s in enumerate(order):
            if s in means.index:
                ax.hlines(means[s], i - 0.3, i + 0.3, color="black", lw=1.6, zorder=3)
        ax.axhline(0.0, color="black", lw=0.8, ls="--")
        ax.set_xlabel("")
        ax.set_ylabel(f"{label(metric)} − {BASELINE}, same seed")
        out.append(finish(
            fig, "paired", "Paired differences per seed", (workload, prec),
            f"Each strategy's {label(metric)} minus `{BASELINE}`'s of the same seed (seeds fix "
            "init and data order): one dot per seed, the black bar at their mean. Below the "
            "dashed line the strategy did better in that seed; dots all on one side are what "
            "the paired tests read as a consistent difference."))
    return out
