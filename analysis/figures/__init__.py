"""Figures of a comparison (seaborn/matplotlib; no display or pyplot state needed).

Each ``*_figures`` function takes the loaded tables and returns a list of :class:`Figure`
(a named matplotlib figure with a title and a caption saying how to read it); a figure whose
data is absent (e.g. no ``act_exp_hist`` was logged) is simply not produced. The report saves
them as PNG and embeds them in the HTML.

* :mod:`analysis.figures.common`    — :class:`Figure`, format ranges, style, shared helpers;
* :mod:`analysis.figures.curves`    — loss curves, scale trajectories, skipped steps;
* :mod:`analysis.figures.underflow` — per-layer underflow heat map, gradient-exponent histogram;
* :mod:`analysis.figures.final`     — final-metric intervals, overhead against model size;
* :mod:`analysis.figures.paired`    — per-seed differences against ``native``;
* :mod:`analysis.figures.fidelity`  — gradient fidelity (lost entries, 1 − cosine) over steps.

Build and save figures inside :func:`figure_rc` (:func:`all_figures` and :func:`save` do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

import pandas as pd

from analysis.figures.common import (FORMAT_RANGES, MAX_PER_KIND, REFERENCE_PRECISION, Figure,
                                     figure_png, figure_rc)
from analysis.figures.curves import (loss_curve_figures, scale_trajectory_figures,
                                     skipped_figures)
from analysis.figures.fidelity import fidelity_curve_figures
from analysis.figures.final import interval_figures, overhead_figures
from analysis.figures.paired import paired_difference_figures
from analysis.figures.underflow import exponent_histogram_figures, underflow_heatmap_figures
from analysis.metrics import SKIPPED_STEPS
from analysis.runset import RunSet

__all__ = ["FORMAT_RANGES", "MAX_PER_KIND", "REFERENCE_PRECISION", "Figure", "all_figures",
           "close_all", "exponent_histogram_figures", "fidelity_curve_figures", "figure_png",
           "figure_rc", "format_range_note", "interval_figures", "loss_curve_figures",
           "overhead_figures", "paired_difference_figures", "save", "scale_trajectory_figures",
           "skipped_figures", "underflow_heatmap_figures"]


def all_figures(rs: RunSet, summary: pd.DataFrame, bench: pd.DataFrame | None = None,
                notes: list[str] | None = None) -> list[Figure]:
    """Every figure of the report, in report order.

    A kind of figure that matplotlib cannot draw from these records (values so large that no
    axis can hold them) is left out and said in one line in ``notes``; the others are drawn.
    """
    builders: list[tuple[str, Callable[[], list[Figure]]]] = [
        ("loss curves", lambda: loss_curve_figures(rs)),
        ("final-metric intervals", lambda: interval_figures(summary)),
        ("paired differences", lambda: paired_difference_figures(rs.runs)),
        ("gradient fidelity over steps", lambda: fidelity_curve_figures(rs)),
        ("scale trajectories", lambda: scale_trajectory_figures(rs)),
        (SKIPPED_STEPS.noun, lambda: skipped_figures(rs)),
        ("underflow heat maps", lambda: underflow_heatmap_figures(rs)),
        ("gradient exponents", lambda: exponent_histogram_figures(rs)),
        ("overhead vs size", lambda: overhead_figures(bench)),
    ]
    figs: list[Figure] = []
    with figure_rc():
        for what, build in builders:
            try:
                figs += build()
            except (ValueError, OverflowError, RuntimeError) as exc:
                _note(notes, f"{what} not drawn", exc)
    return figs


def save(f: Figure, folder: Path, dpi: int = 110, notes: list[str] | None = None
         ) -> Path | None:
    """Write ``f`` as ``<folder>/<name>.png`` (under :func:`figure_rc`); return the path, or
    ``None`` (said in ``notes``) when it cannot be rendered."""
    path = folder / f"{f.name}.png"
    try:
        with figure_rc():
            f.fig.savefig(path, dpi=dpi)
    except (ValueError, OverflowError, RuntimeError) as exc:
        path.unlink(missing_ok=True)
        _note(notes, f"figure {f.name} not drawn", exc)
        return None
    return path


def _note(notes: list[str] | None, what: str, exc: BaseException) -> None:
    if notes is not None:
        notes.append(f"{what}: {type(exc).__name__}: {exc}".splitlines()[0][:300])


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
