"""Figures of a comparison (seaborn/matplotlib; no display or pyplot state needed).

Each ``*_figures`` function takes the loaded tables and returns a list of :class:`Figure`
(a named matplotlib figure with a title and a caption saying how to read it); a figure whose
data is absent (e.g. no ``act_exp_hist`` was logged) is simply not produced. The report saves
them as PNG and embeds them in the HTML.

Representable ranges used by the exponent histogram (``floor(log2|x|)`` of a finite nonzero
value; IEEE 754-2008 binary16/bfloat16/binary32, OCP 8-bit FP spec v1.0 for FP8):

========== ================ ================= ===================
format     min subnormal    min normal        max finite
========== ================ ================= ===================
fp16       2^-24            2^-14             65504 (exp 15)
bf16       2^-133           2^-126            ~3.39e38 (exp 127)
fp32       2^-149           2^-126            ~3.40e38 (exp 127)
fp8_e4m3   2^-9             2^-6              448 (exp 8)
fp8_e5m2   2^-16            2^-14             57344 (exp 15)
========== ================ ================= ===================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import io

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure as MplFigure

from analysis.load import RunSet
from analysis.stats import METRICS, Metric, bootstrap_ci

#: Exponent (floor(log2|x|)) of the smallest subnormal, smallest normal and largest finite value.
FORMAT_RANGES: dict[str, tuple[int, int, int]] = {
    "fp16": (-24, -14, 15),
    "bf16": (-133, -126, 127),
    "fp32": (-149, -126, 127),
    "fp8_e4m3": (-9, -6, 8),
    "fp8_e5m2": (-16, -14, 15),
}

#: Most figures of one kind (per workload × precision) a report draws; the rest are listed.
MAX_PER_KIND = 6
REFERENCE_PRECISION = "fp32"


@dataclass
class Figure:
    """A figure of the report: file stem ``name``, ``title``, reading guide ``caption``."""

    name: str
    title: str
    caption: str
    fig: Any  # matplotlib.figure.Figure


def _subplots(nrows: int, ncols: int, *, figsize: tuple[float, float], **kw: Any
              ) -> tuple[MplFigure, np.ndarray]:
    """A figure and its 2-D axes array, built without pyplot: no global figure registry and no
    GUI backend (saving renders with Agg), so it works the same in a script, a test or a
    notebook kernel whatever backend that kernel chose."""
    fig = MplFigure(figsize=figsize)
    kw.setdefault("squeeze", False)
    return fig, fig.subplots(nrows, ncols, **kw)


def figure_png(fig: MplFigure, dpi: int = 110) -> bytes:
    """PNG bytes of ``fig`` (for ``IPython.display.Image`` in notebooks)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _slug(*parts: object) -> str:
    text = "_".join(str(p) for p in parts)
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def _style() -> None:
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind")


def _palette(strategies: Iterable[str]) -> dict[str, Any]:
    names = sorted({str(s) for s in strategies})
    colours = sns.color_palette("colorblind", max(len(names), 1))
    return dict(zip(names, colours))


def _low_precisions(df: pd.DataFrame) -> list[str]:
    return sorted(p for p in df["precision"].dropna().unique() if p != REFERENCE_PRECISION)


def _cells(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(workload, precision) pairs with data, reference precision excluded, capped."""
    if df.empty:
        return []
    pairs = (df[df["precision"] != REFERENCE_PRECISION][["workload", "precision"]]
             .dropna().drop_duplicates().sort_values(["workload", "precision"]))
    return [tuple(x) for x in pairs.to_numpy()][:MAX_PER_KIND]


def _finite(df: pd.DataFrame, col: str) -> pd.DataFrame:
    out = df.copy()
    out[col] = pd.to_numeric(out[col], errors="coerce")
    out.loc[~np.isfinite(out[col]), col] = np.nan
    return out


# --------------------------------------------------------------------------------------------
# Curves over steps
# --------------------------------------------------------------------------------------------

def mean_band(df: pd.DataFrame, x: str, y: str, n_boot: int = 500) -> pd.DataFrame:
    """Mean of ``y`` over runs at each ``x`` with its 95 % percentile-bootstrap band (the same
    estimator as the report's tables, :func:`analysis.stats.bootstrap_ci`, seed fixed);
    columns ``x``, ``mean``, ``lo``, ``hi`` (lo/hi NaN where fewer than 2 runs)."""
    rows = []
    for xv, g in df.groupby(x, sort=True):
        v = g[y].to_numpy(dtype=float)
        v = v[np.isfinite(v)]
        if v.size == 0:
            continue
        lo, hi = bootstrap_ci(v, "mean", n_boot=n_boot)
        rows.append({x: xv, "mean": float(v.mean()), "lo": lo, "hi": hi})
    return pd.DataFrame(rows, columns=[x, "mean", "lo", "hi"])


def _band_plot(ax: Any, df: pd.DataFrame, x: str, y: str, hue: str, pal: Mapping[str, Any],
               step: bool = False) -> None:
    """One mean line with a shaded 95 % band per ``hue`` value."""
    for name, g in df.groupby(hue, sort=True):
        b = mean_band(g, x, y)
        if b.empty:
            continue
        kw = {"drawstyle": "steps-post"} if step else {}
        ax.plot(b[x], b["mean"], color=pal.get(name), lw=1.4, label=str(name), **kw)
        ax.fill_between(b[x], b["lo"], b["hi"], color=pal.get(name), alpha=0.2, lw=0,
                        step="post" if step else None)

def loss_curve_figures(rs: RunSet) -> list[Figure]:
    """Training loss against step, mean over seeds with a 95 % bootstrap band per strategy, one
    panel per precision, the fp32 reference run(s) as a dashed black line; diverged runs drawn
    thin and dotted on their own."""
    train = rs.train
    if train.empty or train["loss"].isna().all():
        return []
    # loss_avg (mean since the previous train line) is smoother than the one-step loss
    y = "loss_avg" if "loss_avg" in train and train["loss_avg"].notna().any() else "loss"
    _style()
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = _finite(train[train["workload"] == workload], y)
        precs = _low_precisions(wl) or [REFERENCE_PRECISION]
        pal = _palette(rs.runs["strategy"].dropna())
        fig, axes = _subplots(1, len(precs), figsize=(5.2 * len(precs), 3.8), squeeze=False,
                                 sharey=True)
        ref = wl[(wl["precision"] == REFERENCE_PRECISION) & (wl["status"] == "completed")]
        for ax, prec in zip(axes[0], precs):
            cur = wl[(wl["precision"] == prec)]
            done = cur[cur["status"] == "completed"]
            if not done.empty:
                _band_plot(ax, done, "step", y, "strategy", pal)
            for _, run in cur[cur["status"] == "diverged"].groupby("run_id"):
                ax.plot(run["step"], run[y], ls=":", lw=1,
                        color=pal.get(run["strategy"].iloc[0]), label=None)
            if not ref.empty and prec != REFERENCE_PRECISION:
                mean_ref = ref.groupby("step")[y].mean()
                ax.plot(mean_ref.index, mean_ref.to_numpy(), "k--", lw=1.2, label="fp32 reference")
            ax.set_title(f"{prec}")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss" + (" (window mean)" if y == "loss_avg" else ""))
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(f"Loss curves — {workload}")
        fig.tight_layout()
        out.append(Figure(
            _slug("loss", workload), f"Loss curves — {workload}",
            "Mean training loss over seeds (line) with its 95 % bootstrap band, completed runs; "
            "dotted: diverged runs; dashed black: the fp32 reference. A strategy that tracks the "
            "reference loses nothing to reduced precision.", fig))
    return out


def scale_trajectory_figures(rs: RunSet) -> list[Figure]:
    """log2 of the loss scale against step, one thin line per run (hue: strategy); for per-group
    strategies (``layerwise``) a second panel per precision with one line per group."""
    train = rs.train
    if train.empty or train["scale"].isna().all():
        return []
    _style()
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = _finite(train[(train["workload"] == workload)], "scale")
        wl = wl[(wl["scale"] > 0) & (wl["strategy"] != "none")]
        precs = _low_precisions(wl)
        if wl.empty or not precs:
            continue
        wl = wl.assign(log2_scale=np.log2(wl["scale"]))
        gs = rs.group_scales
        gs = gs[(gs["workload"] == workload)] if not gs.empty else gs
        ncols = 2 if not gs.empty else 1
        pal = _palette(rs.runs["strategy"].dropna())
        fig, axes = _subplots(len(precs), ncols, figsize=(5.2 * ncols, 3.4 * len(precs)),
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
                g = _finite(gs[gs["precision"] == prec], "scale")
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
                    a.legend(fontsize=7)
        fig.suptitle(f"Scale trajectories — {workload}")
        fig.tight_layout()
        out.append(Figure(
            _slug("scales", workload), f"Scale trajectories — {workload}",
            "log2 of the loss scale after each update, one line per run. Steps down are backoffs "
            "after non-finite gradients; a scale pinned at its bound means the rule saturated. "
            "Right: one scale per layer group (layerwise).", fig))
    return out


def skipped_figures(rs: RunSet) -> list[Figure]:
    """Cumulative skipped steps against step: mean over seeds with 95 % band, per precision."""
    train = rs.train
    if train.empty or train["skipped_total"].isna().all():
        return []
    _style()
    out = []
    for workload in sorted(train["workload"].dropna().unique()):
        wl = _finite(train[train["workload"] == workload], "skipped_total")
        wl = wl[wl["status"].isin(["completed", "diverged"])]
        precs = _low_precisions(wl)
        if not precs:
            continue
        pal = _palette(rs.runs["strategy"].dropna())
        fig, axes = _subplots(1, len(precs), figsize=(5.2 * len(precs), 3.4), squeeze=False,
                                 sharey=True)
        for ax, prec in zip(axes[0], precs):
            cur = wl[wl["precision"] == prec]
            _band_plot(ax, cur, "step", "skipped_total", "strategy", pal, step=True)
            ax.legend(fontsize=7)
            ax.set_title(prec)
            ax.set_ylabel("skipped steps so far")
        fig.suptitle(f"Skipped steps — {workload}")
        fig.tight_layout()
        out.append(Figure(
            _slug("skipped", workload), f"Skipped steps — {workload}",
            "Cumulative optimizer steps skipped for non-finite gradients (mean over completed and "
            "diverged runs, 95 % band). Each skip is a wasted step; a dynamic scaler pays a few "
            "at the start while it finds its scale, and one per growth attempt that overflows.",
            fig))
    return out


# --------------------------------------------------------------------------------------------
# Underflow: per-layer heat map and exponent histogram
# --------------------------------------------------------------------------------------------

def underflow_heatmap_figures(rs: RunSet) -> list[Figure]:
    """Per workload × precision: one heat map per strategy of the activation-gradient zero
    fraction (``act_zero_frac``), layers × logged step, averaged over seeds."""
    layers = rs.layers
    if layers.empty or layers["act_zero_frac"].isna().all():
        return []
    _style()
    out = []
    for workload, prec in _cells(layers):
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
        fig, axes = _subplots(n, 1, figsize=(7.5, 0.5 + (0.32 * len(order) + 0.6) * n),
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
        fig.suptitle(f"Activation-gradient zero fraction — {workload}, {prec}")
        fig.tight_layout()
        if image is not None:
            fig.colorbar(image, ax=axes[:, 0].tolist(), label="zero fraction", shrink=0.9)
        out.append(Figure(
            _slug("underflow", workload, prec), f"Underflow heat map — {workload}, {prec}",
            "Fraction of each layer's activation gradient that is exactly zero, per logged step "
            "(mean over seeds). Darker is more zeros: gradient information lost to underflow, on "
            "top of structural zeros (ReLU) that the fp32 reference (top panel, when run) has as well.",
            fig))
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
    _style()
    out = []
    for workload, prec in _cells(hist):
        cur = hist[(hist["workload"] == workload) & (hist["precision"] == prec)]
        strategies = sorted(cur["strategy"].dropna().unique())
        ref = hist[(hist["workload"] == workload) & (hist["precision"] == REFERENCE_PRECISION)]
        ref_frac = _hist_fractions(ref)[0] if not ref.empty else None
        rng = FORMAT_RANGES.get(prec)
        fig, axes = _subplots(len(strategies), 1, figsize=(7.5, 1.9 * len(strategies) + 0.6),
                                 squeeze=False, sharex=True)
        pal = _palette(rs.runs["strategy"].dropna())
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
            ax.legend(fontsize=6, loc="upper right")
        axes[-1, 0].set_xlabel("floor(log2 |activation gradient|), scaled")
        fig.suptitle(f"Gradient exponents vs the {prec} range — {workload}")
        fig.tight_layout()
        out.append(Figure(
            _slug("exponents", workload, prec), f"Gradient exponents — {workload}, {prec}",
            f"Histogram of the exponents of the scaled activation gradients, all layers, summed "
            "over the logged steps and seeds (exponents beyond the logged bins are clamped into "
            "the end bins). Shaded: the {prec} "
            "subnormal (orange) and normal (green) ranges; dashed red: below the left line values "
            "flush to zero, beyond the right one they overflow to inf. Loss scaling shifts the "
            "histogram right (by log2 S) so that it fits inside the range; the outline is the "
            "unscaled fp32 reference.", fig))
    return out


# --------------------------------------------------------------------------------------------
# Final metrics and benchmark
# --------------------------------------------------------------------------------------------

def interval_figures(summary: pd.DataFrame, metrics: Sequence[Metric] = METRICS) -> list[Figure]:
    """Per workload: one panel per metric, each strategy × precision's mean (dot) with its 95 %
    bootstrap interval (bar) and IQM (open diamond) — rliable's interval-estimate plot."""
    if summary.empty:
        return []
    _style()
    out = []
    for workload in sorted(summary["workload"].dropna().unique()):
        cell = summary[summary["workload"] == workload].sort_values(["precision", "strategy"])
        present = [m for m in metrics if f"{m.column}_mean" in cell
                   and cell[f"{m.column}_mean"].notna().any()]
        if not present:
            continue
        labels = (cell["strategy"] + " · " + cell["precision"]).tolist()
        y = np.arange(len(labels))
        pal = _palette(cell["precision"])
        fig, axes = _subplots(1, len(present), figsize=(3.6 * len(present),
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
        fig.suptitle(f"Final metrics, 95 % bootstrap intervals over seeds — {workload}")
        fig.tight_layout()
        out.append(Figure(
            _slug("intervals", workload), f"Final metrics — {workload}",
            "Dot: mean over seeds; bar: 95 % percentile-bootstrap interval of the mean; open "
            "diamond: interquartile mean. Lower is better in every panel. Overlapping bars mean "
            "the seeds cannot tell the strategies apart.", fig))
    return out


def overhead_figures(bench: pd.DataFrame | None) -> list[Figure]:
    """Strategy overhead against model size from ``scalelab-bench``
    (:func:`analysis.bench.load_bench`): left, median per-step time of scale + unscale_ + step +
    update (log-log); right, the same as a ratio to ``torch.amp.GradScaler`` at each size."""
    if bench is None or bench.empty:
        return []
    _style()
    pal = _palette(bench["name"])
    has_ratio = bench["ratio_vs_gradscaler"].notna().any()
    fig, axes = _subplots(1, 2 if has_ratio else 1, figsize=(11 if has_ratio else 6, 3.8),
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
    fig.suptitle("Strategy overhead vs model size (scalelab-bench)")
    fig.tight_layout()
    return [Figure("overhead_vs_size", "Strategy overhead vs model size",
                   "From `scalelab-bench`: median time per step of scale + unscale_ + step + "
                   "update with a no-op optimizer (forward/backward excluded), every "
                   "configuration measured side by side in one process; right, relative to "
                   "torch.amp.GradScaler at the same size (dashed line = parity). norm_ratio is "
                   "measured without its fp32 probe, whose cost the training runs record.", fig)]


def all_figures(rs: RunSet, summary: pd.DataFrame, bench: pd.DataFrame | None = None
                ) -> list[Figure]:
    """Every figure of the report, in report order."""
    figs: list[Figure] = []
    figs += loss_curve_figures(rs)
    figs += interval_figures(summary)
    figs += scale_trajectory_figures(rs)
    figs += skipped_figures(rs)
    figs += underflow_heatmap_figures(rs)
    figs += exponent_histogram_figures(rs)
    figs += overhead_figures(bench)
    return figs


def close_all(figs: Iterable[Figure]) -> None:
    """Release the figures' artists now rather than at garbage collection."""
    for f in figs:
        f.fig.clear()


def format_range_note(precision: str) -> str:
    """One line naming the representable range of ``precision`` (for captions and text)."""
    rng: Mapping[str, tuple[int, int, int]] = FORMAT_RANGES
    if precision not in rng:
        return f"{precision}: range unknown"
    sub, norm, top = rng[precision]
    return (f"{precision}: subnormal from 2^{sub}, normal from 2^{norm}, largest exponent {top}")
