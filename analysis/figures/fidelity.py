"""Gradient fidelity over steps: lost gradient entries and 1 − cosine to the fp32 gradient at
each fidelity probe, one line per strategy with a band over seeds (issue 12, figures).

The y axes are symlog when a panel's positive values span more than two decades: linear
between 0 and the smallest positive value (rounded down to a power of ten), logarithmic above,
so a lost fraction of exactly 0 (nothing lost) stays on the axis instead of being clipped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, NullFormatter

from analysis.figures.common import (Figure, band_plot, cells, finish, finite, legend_outside,
                                     palette, subplots)
from analysis.metrics import LOST_ENTRIES, ONE_MINUS_COS, SKIPPED_STEPS, Metric
from analysis.runset import RunSet

__all__ = ["PANELS", "fidelity_curve_figures"]

#: (column of the fidelity table, the run metric that is its mean over probes) per panel.
PANELS: tuple[tuple[str, Metric], ...] = (("lost_frac", LOST_ENTRIES),
                                          ("one_minus_cos", ONE_MINUS_COS))


def fidelity_curve_figures(rs: RunSet) -> list[Figure]:
    """Per workload × reduced precision with probes: lost fraction and 1 − cosine against step,
    mean over completed runs (seeds) per strategy with seaborn's 95 % bootstrap band; probes of
    skipped steps (no comparison) left out. Nothing is drawn for runs without fidelity lines."""
    fid = rs.fidelity
    if fid.empty or not {"lost_frac", "cosine"} <= set(fid.columns):
        return []
    fid = fid[fid["status"] == "completed"]
    if "skipped" in fid:
        fid = fid[~fid["skipped"].map(lambda x: x is True)]
    fid = finite(finite(fid, "lost_frac"), "cosine")
    fid = fid.assign(one_minus_cos=1.0 - fid["cosine"])
    fid = fid.dropna(subset=["lost_frac", "one_minus_cos"], how="all")
    pal = palette(rs.runs["strategy"].dropna())
    out = []
    for workload, prec in cells(fid):
        cur = fid[(fid["workload"] == workload) & (fid["precision"] == prec)]
        fig, axes = subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 3.6))
        scales = []
        for ax, (col, m) in zip(axes[0], PANELS):
            band_plot(ax, cur, "step", col, "strategy", pal)
            scales.append(_symlog_if_wide(ax, cur[col]))
            ax.set_xlabel("step")
            ax.set_ylabel(f"{m.label} ({m.unit})" if m.unit else m.label)
            legend_outside(ax)
        scale_note = ("Symlog y (linear near 0, log above the smallest positive value) where "
                      "values span more than two decades: " + ", ".join(
                          f"{m.label}: {'symlog' if s else 'linear'}"
                          for (_, m), s in zip(PANELS, scales)) + ".")
        out.append(finish(
            fig, "fidelity", "Gradient fidelity over steps", (workload, prec),
            "At each fidelity probe (train.fidelity_every), the fraction of gradient entries "
            "nonzero in fp32 but zero in mixed precision (left) and 1 − cosine of the unscaled "
            "mixed-precision gradient and the fp32 gradient of the same weights and batch "
            "(right): mean over completed runs (seeds) per strategy with its 95 % bootstrap "
            f"band; probes at {SKIPPED_STEPS.noun} left out. Lower is closer to fp32. "
            + scale_note))
    return out


def _symlog_if_wide(ax: Any, values: pd.Series) -> bool:
    """Symlog y when the positive values span more than two decades, ticks as plain numbers
    (mathtext is off) and the axis from 0 (or the lowest value) up; whether symlog was set."""
    v = values.to_numpy(dtype=float)
    v = v[np.isfinite(v)]
    pos = v[v > 0]
    if pos.size == 0 or pos.max() / pos.min() <= 100:
        return False
    ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(pos.min())))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0e}" if x else "0"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=min(0.0, float(v.min())))
    return True
