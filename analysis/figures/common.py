"""Shared pieces of the report's figures: the :class:`Figure` record, the format ranges, the
matplotlib settings every figure is drawn and saved under, and small table helpers.

Labels carry strings from run records (strategy, workload, layer and group names) that a careless
or hostile writer controls; :func:`figure_rc` turns off mathtext and TeX (``text.parse_math`` and
``text.usetex`` false), so a ``$\\foo$`` or an unbalanced ``$`` is drawn as typed, never parsed.
Build **and save** figures inside it (ticks are created at draw time).

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

import contextlib
import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure as MplFigure

from analysis.stats import SEED
from analysis.targets import REFERENCE_PRECISION
from analysis.text import code

__all__ = ["FORMAT_RANGES", "Figure", "MAX_PER_KIND", "PALETTE", "REFERENCE_PRECISION",
           "band_plot", "figure_png", "figure_rc", "legend_outside", "palette"]

#: Exponent (floor(log2|x|)) of the smallest subnormal, smallest normal and largest finite value.
FORMAT_RANGES: dict[str, tuple[int, int, int]] = {
    "fp16": (-24, -14, 15),
    "bf16": (-133, -126, 127),
    "fp32": (-149, -126, 127),
    "fp8_e4m3": (-9, -6, 8),
    "fp8_e5m2": (-16, -14, 15),
}

#: Most figures of one kind (per workload × precision) a report draws; the rest are listed.
#: The default comparison has 7 cells below fp32 (fp16 x 3 regimes, fp8_e5m2, bf16 x 3).
MAX_PER_KIND = 12


@dataclass
class Figure:
    """A figure of the report: file stem ``name``, ``title``, reading guide ``caption``."""

    name: str
    title: str
    caption: str
    fig: Any  # matplotlib.figure.Figure


#: matplotlib settings of every figure: text drawn as typed (no mathtext, no TeX).
RC = {"text.parse_math": False, "text.usetex": False}


@contextlib.contextmanager
def figure_rc() -> Iterator[None]:
    """Draw and save figures under the report's style with mathtext and TeX off (the style's
    global changes are undone on exit)."""
    with matplotlib.rc_context(), warnings.catch_warnings(), np.errstate(all="ignore"):
        # long run-record names can leave no room for tight_layout, and means of huge values
        # overflow to inf: the figure is still drawn, the tables say what the values were
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        sns.set_theme(context="paper", style="whitegrid", palette="colorblind")
        matplotlib.rcParams.update(RC)
        yield


def finish(fig: MplFigure, kind: str, title: str, key: tuple[object, ...], caption: str
           ) -> Figure:
    """Title ``fig`` "<title> — <key…>", lay it out, and wrap it as a report :class:`Figure`
    (file stem from ``kind`` and ``key``; in the report's title the key is code, inert)."""
    fig.suptitle(f"{title} — " + ", ".join(str(k) for k in key))
    fig.tight_layout()
    return Figure(slug(kind, *key), f"{title} — " + ", ".join(code(k) for k in key), caption, fig)


def subplots(nrows: int, ncols: int, *, figsize: tuple[float, float], **kw: Any
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
    with figure_rc():
        fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def slug(*parts: object) -> str:
    """A file stem from run-record names: ASCII letters and digits, ``-`` for anything else; a
    long one is cut and keeps a short hash so that names stay distinct."""
    text = "_".join(str(p) for p in parts)
    out = "".join(c if c.isascii() and c.isalnum() else "-" for c in text).strip("-").lower()
    if len(out) > 80:
        out = out[:70] + "-" + hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:8]
    return out or "figure"


#: The strategies' colours (issue 30: no repeats among the 12 rules): seaborn's ``colorblind``
#: ten, then ten more picked greedily from seaborn's palettes (``dark``, ``pastel``, ``bright``,
#: ``Set1``, ``Set2``, ``Dark2``, ``tab20``; none near white or black), each the farthest in RGB
#: from those before it. The smallest distance between any two of the 20 is 0.196, the
#: colorblind ten's own smallest (``tests/analysis/test_glance.py``).
PALETTE = ("#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc", "#ca9161", "#fbafe4",
           "#949494", "#ece133", "#56b4e9", "#591e71", "#66a61e", "#8b2be2", "#e7298a",
           "#e8000b", "#00d7ff", "#023eff", "#dbdb8d", "#8c564b", "#9edae5")


def palette(strategies: Iterable[str]) -> dict[str, Any]:
    """A colour per strategy name (sorted), distinct for up to ``len(PALETTE)`` = 20 names."""
    names = sorted({str(s) for s in strategies})
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def legend_outside(ax: Any, fontsize: int = 7) -> None:
    """The axes' legend (when it has entries) to the right of the plot, off the data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, frameon=False)


def low_precisions(df: pd.DataFrame) -> list[str]:
    return sorted(p for p in df["precision"].dropna().unique() if p != REFERENCE_PRECISION)


def cells(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(workload, precision) pairs with data, reference precision excluded, capped."""
    if df.empty:
        return []
    pairs = (df[df["precision"] != REFERENCE_PRECISION][["workload", "precision"]]
             .dropna().drop_duplicates().sort_values(["workload", "precision"]))
    return [tuple(x) for x in pairs.to_numpy()][:MAX_PER_KIND]


def finite(df: pd.DataFrame, col: str) -> pd.DataFrame:
    out = df.copy()
    out[col] = pd.to_numeric(out[col], errors="coerce")
    out.loc[~np.isfinite(out[col]), col] = np.nan
    return out


#: Most distinct x values (logged steps) one band plot draws; a longer run is drawn at this
#: many steps spread evenly over it (first and last included), so the figure's time is bounded.
MAX_BAND_POINTS = 400


def band_plot(ax: Any, df: pd.DataFrame, x: str, y: str, hue: str, pal: Mapping[str, Any],
              step: bool = False, n_boot: int = 200) -> None:
    """One mean line per ``hue`` value with seaborn's 95 % percentile-bootstrap band over runs
    at each ``x`` (``errorbar=("ci", 95)``, seed fixed; 200 resamples: a band over a handful of
    seeds at every step, drawn, not read — the tables' intervals use 2000), at no more than
    :data:`MAX_BAND_POINTS` values of ``x``."""
    data = df.dropna(subset=[y])
    if data.empty:
        return
    xs = np.sort(data[x].dropna().unique())
    if xs.size > MAX_BAND_POINTS:
        keep = xs[np.unique(np.linspace(0, xs.size - 1, MAX_BAND_POINTS).round().astype(int))]
        data = data[data[x].isin(keep)]
    kw: dict[str, Any] = {"drawstyle": "steps-post", "err_kws": {"step": "post"}} if step else {}
    sns.lineplot(data=data, x=x, y=y, hue=hue, palette=pal, errorbar=("ci", 95), n_boot=n_boot,
                 seed=SEED, lw=1.4, ax=ax, **kw)
