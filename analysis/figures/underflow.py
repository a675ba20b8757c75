"""Underflow figures: per-layer activation-gradient zero fraction over time, and the histogram
of gradient exponents against the format's representable range."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.figures.common import (FORMAT_RANGES, REFERENCE_PRECISION, Figure, cells, finish,
                                     legend_outside, palette, subplots)
from analysis.runset import RunSet

__all__ = ["exponent_histogram_figures", "underflow_heatmap_figures"]


def underflow_heatmap_figures(rs: RunSet) -> list[Figure]:
    """Per workload × precision: one heat map per strategy of the activation-gradient zero
    fraction (``act_zero_frac``), layers × logged step, averaged over seeds."""
    layers = rs.layers
    if layers.empty or layers["act_zero_frac"].isna().all():
        return []
    out = []
    for workload, prec in cells(layers):
        cur = layers[(layers["workload"] == workload) & (layers["precision"] == prec)
                     & layers["status"].isin(["completed", "diverged"])]
        panels = [(s, cur[cur["strategy"] == s]) for s in sorted(cur["strategy"].dropna().unique())]
        if not panels:
            continue
        ref = layers[(layers["workload"] == workload)
                     & (layers["precision"] == REFERENCE_PRECISION)
                     & (layers["status"] == "completed")]
        if not ref.empty:
            panels.insert(0, (f"{REFERENCE_PRECISION} reference", ref))
        order = (cur.groupby("layer")["layer_order"].min().sort_values().index.tolist())
        vmax = max(max(float(d["act_zero_frac"].max()) for _, d in panels), 1e-6)
        n = len(panels)
        fig, axes = subplots(n, 1, figsize=(7.5, 0.5 + (0.32 * len(order) + 0.6) * n),
                             squeeze=False)
        image = None
        for ax, (label, data) in zip(axes[:, 0], panels):
            grid = (data.pivot_table(index="layer", columns="step", values="act_zero_frac",
                                     aggfunc="mean").reindex(order))
            steps = grid.columns.to_numpy()
            image = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", cmap="rocket_r",
                              vmin=0.0, vmax=vmax, interpolation="nearest")
            ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int))
            ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
            ax.set_yticks(range(len(order)), order)
            ax.grid(False)
            ax.set_title(label, fontsize=9)
            ax.set_ylabel("layer")
        axes[-1, 0].set_xlabel("step")
        out.append(finish(
            fig, "underflow", "Underflow heat map", (workload, prec),
            "Fraction of each layer's activation gradient that is exactly zero, per logged step "
            "(mean over seeds). Darker is more zeros: gradient information lost to underflow, on "
            "top of structural zeros (ReLU) that the fp32 reference (top panel, when run) has "
            "as well."))
        if image is not None:
            fig.colorbar(image, ax=axes[:, 0].tolist(), label="zero fraction", shrink=0.9)
    return out


def _hist_fractions(h: pd.DataFrame) -> tuple[pd.Series, float]:
    """(fraction per exponent, zero fraction) of a histogram table summed over rows."""
    counts = h.dropna(subset=["exponent"]).groupby("exponent")["count"].sum()
    zeros = float(h.drop_duplicates(["run_id", "step"])["zeros"].sum())
    total = float(counts.sum()) + zeros
    if total <= 0:
        return counts, 0.0
    return counts / total, zeros / total


def exponent_histogram_figures(rs: RunSet) -> list[Figure]:
    """The classic loss-scaling figure (Micikevicius et al., *Mixed Precision Training*, ICLR
    2018, Fig. 3): histogram of ``floor(log2|g|)`` of the (scaled) activation gradients, summed
    over logged steps and seeds, one panel per strategy, with the format's subnormal and normal
    ranges shaded and its largest finite exponent marked. The fp32 reference's histogram is
    overlaid as a black outline when present; the exact-zero fraction is printed per panel."""
    hist = rs.exp_hist
    if hist.empty:
        return []
    out = []
    for workload, prec in cells(hist):
        cur = hist[(hist["workload"] == workload) & (hist["precision"] == prec)]
        strategies = sorted(cur["strategy"].dropna().unique())
        ref = hist[(hist["workload"] == workload) & (hist["precision"] == REFERENCE_PRECISION)]
        ref_frac = _hist_fractions(ref)[0] if not ref.empty else None
        rng = FORMAT_RANGES.get(prec)
        fig, axes = subplots(len(strategies), 1, figsize=(7.5, 1.9 * len(strategies) + 0.6),
                             squeeze=False, sharex=True)
        pal = palette(rs.runs["strategy"].dropna())
        for ax, strat in zip(axes[:, 0], strategies):
            frac, zero_frac = _hist_fractions(cur[cur["strategy"] == strat])
            ax.bar(frac.index.to_numpy(dtype=float), frac.to_numpy(), width=1.0,
                   color=pal[strat], alpha=0.85, label=strat)
            if ref_frac is not None and not ref_frac.empty:
                ax.step(ref_frac.index.to_numpy(dtype=float), ref_frac.to_numpy(), where="mid",
                        color="black", lw=0.9, label="fp32 reference")
            if rng is not None:
                sub, norm, top = rng
                ax.axvspan(sub - 0.5, norm - 0.5, color="tab:orange", alpha=0.15,
                           label=f"{prec} subnormal")
                ax.axvspan(norm - 0.5, top + 0.5, color="tab:green", alpha=0.10,
                           label=f"{prec} normal")
                ax.axvline(sub - 0.5, color="tab:red", lw=1, ls="--")
                ax.axvline(top + 0.5, color="tab:red", lw=1, ls="--")
            ax.text(0.01, 0.92, f"{strat}: exact zeros {zero_frac:.1%}", transform=ax.transAxes,
                    fontsize=8, va="top")
            ax.set_ylabel("fraction")
            legend_outside(ax, fontsize=6)
        axes[-1, 0].set_xlabel("floor(log2 |activation gradient|), scaled")
        out.append(finish(
            fig, "exponents", "Gradient exponents", (workload, prec),
            f"Histogram of the exponents of the scaled activation gradients, all layers, summed "
            "over the logged steps and seeds (exponents beyond the logged bins are clamped into "
            "the end bins). Shaded: the {prec} "
            "subnormal (orange) and normal (green) ranges; dashed red: below the left line values "
            "flush to zero, beyond the right one they overflow to inf. Loss scaling shifts the "
            "histogram right (by log2 S) so that it fits inside the range; the outline is the "
            "unscaled fp32 reference."))
    return out


