"""Figures of a comparison (seaborn/matplotlib; no display or pyplot state needed).

Each ``*_figures`` function takes the loaded tables and returns a list of :class:`Figure`
(a named matplotlib figure with a title and a caption saying how to read it); a figure whose
data is absent (e.g. no ``act_exp_hist`` was logged) is simply not produced. The report saves
them as PNG and embeds them in the HTML.

* :mod:`analysis.figures.common`    — :class:`Figure`, format ranges, style, shared helpers;
* :mod:`analysis.figures.curves`    — loss curves, scale trajectories, skipped steps;
* :mod:`analysis.figures.underflow` — per-layer underflow heat map, gradient-exponent histogram;
* :mod:`analysis.figures.final`     — final-metric intervals, overhead against model size.

Build and save figures inside :func:`figure_rc` (:func:`all_figures` and :func:`save` do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import pandas as pd

from analysis.figures.common import (FORMAT_RANGES, MAX_PER_KIND, REFERENCE_PRECISION, Figure,
                                     figure_png, figure_rc)
from analysis.figures.curves import (loss_curve_figures, scale_trajectory_figures,
                                     skipped_figures)
from analysis.figures.final import interval_figures, overhead_figures
from analysis.figures.underflow import exponent_histogram_figures, underflow_heatmap_figures
from analysis.runset import RunSet

__all__ = ["FORMAT_RANGES", "MAX_PER_KIND", "REFERENCE_PRECISION", "Figure", "all_figures",
           "close_all", "exponent_histogram_figures", "figure_png", "figure_rc",
           "format_range_note", "interval_figures", "loss_curve_figures", "overhead_figures",
           "save", "scale_trajectory_figures", "skipped_figures", "underflow_heatmap_figures"]


def all_figures(rs: RunSet, summary: pd.DataFrame, bench: pd.DataFrame | None = None
                ) -> list[Figure]:
    """Every figure of the report, in report order."""
    with figure_rc():
        figs: list[Figure] = []
        figs += loss_curve_figures(rs)
        figs += interval_figures(summary)
        figs += scale_trajectory_figures(rs)
        figs += skipped_figures(rs)
        figs += underflow_heatmap_figures(rs)
        figs += exponent_histogram_figures(rs)
        figs += overhead_figures(bench)
    return figs


def save(f: Figure, folder: Path, dpi: int = 110) -> Path:
    """Write ``f`` as ``<folder>/<name>.png`` (under :func:`figure_rc`); return the path."""
    path = folder / f"{f.name}.png"
    with figure_rc():
        f.fig.savefig(path, dpi=dpi)
    return path


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
