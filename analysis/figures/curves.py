"""Curves over steps: training loss against the fp32 reference, loss-scale trajectories,
cumulative skipped steps (seaborn lines; bands are seaborn's 95 % bootstrap intervals)."""

from __future__ import annotations

import numpy as np
import seaborn as sns

from analysis.figures.common import (REFERENCE_PRECISION, Figure, band_plot, finish, finite,
                                     legend_outside, low_precisions, palette, subplots)
from analysis.metrics import SKIPPED_STEPS
from analysis.runset import RunSet

__all__ = ["loss_curve_figures", "scale_trajectory_figures", "skipped_figures"]


def loss_curve_figures(rs: RunSet) -> list[Figure]:
    """Training loss against step, mean over seeds with a 95 % bootstrap band per strategy, one
    panel per precision, the fp32 reference run(s) as a dashed black line; diverged runs drawn
    thin and dotted on their own."""
    train = rs.train
    if train.empty or train["loss"].isna().all():
        return []
    # loss_avg (mean since the previous train line) is smoother than the one-step loss
    y = "loss_avg" if "loss_avg" in train and train["loss_avg"].notna().any() else "loss"
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = finite(train[train["workload"] == workload], y)
        precs = low_precisions(wl) or [REFERENCE_PRECISION]
        pal = palette(rs.runs["strategy"].dropna())
        fig, axes = subplots(1, len(precs), figsize=(5.2 * len(precs), 3.8), squeeze=False,
                             sharey=True)
        ref = wl[(wl["precision"] == REFERENCE_PRECISION) & (wl["status"] == "completed")]
        for ax, prec in zip(axes[0], precs):
            cur = wl[(wl["precision"] == prec)]
            done = cur[cur["status"] == "completed"]
            if not done.empty:
                band_plot(ax, done, "step", y, "strategy", pal)
            for _, run in cur[cur["status"] == "diverged"].groupby("run_id"):
                ax.plot(run["step"], run[y], ls=":", lw=1,
                        color=pal.get(run["strategy"].iloc[0]), label=None)
            if not ref.empty and prec != REFERENCE_PRECISION:
                mean_ref = ref.groupby("step")[y].mean()
                ax.plot(mean_ref.index, mean_ref.to_numpy(), "k--", lw=1.2, label="fp32 reference")
            ax.set_title(f"{prec}")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss" + (" (window mean)" if y == "loss_avg" else ""))
            legend_outside(ax)
        out.append(finish(
            fig, "loss", "Loss curves", (workload,),
            "Mean training loss over seeds (line) with its 95 % bootstrap band, completed runs; "
            "dotted: diverged runs; dashed black: the fp32 reference. A strategy that tracks the "
            "reference loses nothing to reduced precision."))
    return out


def scale_trajectory_figures(rs: RunSet) -> list[Figure]:
    """log2 of the loss scale against step, one thin line per run (hue: strategy); for per-group
    strategies (``layerwise``) a second panel per precision with one line per group."""
    train = rs.train
    if train.empty or train["scale"].isna().all():
        return []
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = finite(train[(train["workload"] == workload)], "scale")
        wl = wl[(wl["scale"] > 0) & (wl["strategy"] != "none")]
        precs = low_precisions(wl)
        if wl.empty or not precs:
            continue
        wl = wl.assign(log2_scale=np.log2(wl["scale"]))
        gs = rs.group_scales
        gs = gs[(gs["workload"] == workload)] if not gs.empty else gs
        ncols = 2 if not gs.empty else 1
        pal = palette(rs.runs["strategy"].dropna())
        fig, axes = subplots(len(precs), ncols, figsize=(5.2 * ncols, 3.4 * len(precs)),
                             squeeze=False)
        for row, prec in enumerate(precs):
            ax = axes[row][0]
            cur = wl[wl["precision"] == prec]
            if not cur.empty:
                sns.lineplot(data=cur, x="step", y="log2_scale", hue="strategy", units="run_id",
                             estimator=None, palette=pal, lw=0.9, alpha=0.8, ax=ax)
            ax.set_title(f"{prec}: loss scale per run")
            ax.set_ylabel("log2(scale)")
            if ncols == 2:
                ax2 = axes[row][1]
                g = finite(gs[gs["precision"] == prec], "scale")
                g = g[g["scale"] > 0]
                if not g.empty:
                    g = g.assign(log2_scale=np.log2(g["scale"]),
                                 series=g["strategy"] + ": " + g["group"])
                    sns.lineplot(data=g, x="step", y="log2_scale", hue="series",
                                 units="run_id", estimator=None, lw=0.9, alpha=0.8, ax=ax2)
                ax2.set_title(f"{prec}: per-group scales")
                ax2.set_ylabel("log2(scale)")
            for a in axes[row]:
                if a.get_legend() is not None:
                    legend_outside(a)
        out.append(finish(
            fig, "scales", "Scale trajectories", (workload,),
            "log2 of the loss scale after each update, one line per run. Steps down are backoffs "
            "after non-finite gradients; a scale pinned at its bound means the rule saturated. "
            "Right: one scale per layer group (layerwise)."))
    return out


def skipped_figures(rs: RunSet) -> list[Figure]:
    """Cumulative skipped steps against step: mean over seeds with 95 % band, per precision."""
    train = rs.train
    if train.empty or train["skipped_total"].isna().all():
        return []
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = finite(train[train["workload"] == workload], "skipped_total")
        wl = wl[wl["status"].isin(["completed", "diverged"])]
        precs = low_precisions(wl)
        if not precs:
            continue
        pal = palette(rs.runs["strategy"].dropna())
        fig, axes = subplots(1, len(precs), figsize=(5.2 * len(precs), 3.4), squeeze=False,
                             sharey=True)
        for ax, prec in zip(axes[0], precs):
            cur = wl[wl["precision"] == prec]
            band_plot(ax, cur, "step", "skipped_total", "strategy", pal, step=True)
            legend_outside(ax)
            ax.set_title(prec)
            ax.set_ylabel(f"{SKIPPED_STEPS.noun} so far")
        out.append(finish(
            fig, "skipped", SKIPPED_STEPS.noun.capitalize(), (workload,),
            "Cumulative optimizer steps skipped for non-finite gradients (mean over completed and "
            "diverged runs, 95 % band). Each skip is a wasted step; a dynamic scaler pays a few "
            "at the start while it finds its scale, and one per growth attempt that overflows."))
    return out


