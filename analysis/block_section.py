"""The report's block-scaling section: for runs in a block-scaled precision mode (``mxfp8``,
``fp8_blockwise``, ``nvfp4``; issue 31), what the casts of every Linear did, per role and layer.

From the ``blocks`` table of a :class:`~analysis.runset.RunSet` (one row per run, logging step,
layer and role of the run's ``block_stats``, ``experiments/block_linear.py``):

* ``clipped_share`` — blocks whose max element saturates the element format (OCP FLOOR scales clip
  a max whose mantissa exceeds ``elem_max / 2^max_pow2``), over the blocks cast;
* ``flushed_share`` — nonzero entries the cast sent to zero;
* the scale-exponent range — the lowest and highest power of two among the block scales
  (``scale_exp_lo`` .. ``scale_exp_hi``);

pooled over every run of a precision, logging step and both copies of a role (row- and
column-wise), each share weighted by the blocks cast. Rows are ordered worst first (clipped share,
then flushed share), and one line reads the worst.
"""

from __future__ import annotations

import pandas as pd

from analysis.document import Document
from analysis.runset import RunSet
from analysis.text import code, pct

__all__ = ["MAX_ROWS", "block_reading", "block_section", "block_table"]

MAX_ROWS = 30
"""Rows shown per precision mode (the worst); the rest are counted in the caption."""

_COLUMNS = ["precision", "role", "layer", "runs", "blocks", "clipped_share", "flushed_share",
            "scale_exp_lo", "scale_exp_hi"]


def block_table(blocks: pd.DataFrame) -> pd.DataFrame:
    """One row per (precision, role, layer): runs, blocks cast, the blocks-weighted
    ``clipped_share`` and ``flushed_share``, and the scale-exponent range; worst first within each
    precision (clipped share, then flushed share, descending)."""
    if blocks.empty or "blocks" not in blocks:
        return pd.DataFrame(columns=_COLUMNS)
    rows = blocks.assign(**{c: float("nan") for c in ("clipped_share", "flushed_share", "scale_exp_lo",
                                                       "scale_exp_hi") if c not in blocks}).dropna(subset=["blocks"])
    rows = rows[rows["blocks"] > 0] if not rows.empty else rows
    if rows.empty:
        return pd.DataFrame(columns=_COLUMNS)
    out = []
    for (prec, role, layer), g in rows.groupby(["precision", "role", "layer"], sort=True, dropna=False):
        n = float(g["blocks"].sum())
        share = {k: float((g[k] * g["blocks"]).sum() / g.loc[g[k].notna(), "blocks"].sum())
                 if g[k].notna().any() else float("nan") for k in ("clipped_share", "flushed_share")}
        out.append({"precision": prec, "role": role, "layer": layer, "runs": int(g["run_id"].nunique()),
                    "blocks": n, **share, "scale_exp_lo": g["scale_exp_lo"].min(),
                    "scale_exp_hi": g["scale_exp_hi"].max()})
    table = pd.DataFrame(out, columns=_COLUMNS)
    return table.sort_values(["precision", "clipped_share", "flushed_share", "role", "layer"],
                             ascending=[True, False, False, True, True], na_position="last", kind="stable"
                             ).reset_index(drop=True)


def _exp(x: float) -> str:
    return "–" if pd.isna(x) else f"{int(x)}"


def block_reading(table: pd.DataFrame, precision: str) -> str:
    """One line on ``precision``'s rows of :func:`block_table`: its worst (role, layer) and the
    whole mode's exponent range."""
    t = table[table["precision"] == precision]
    if t.empty:
        return f"{code(precision)}: no block statistics recorded."
    worst = t.iloc[0]
    lo, hi = t["scale_exp_lo"].min(), t["scale_exp_hi"].max()
    head = "no block clips its max element" if not worst["clipped_share"] > 0 else (
        f"worst {code(worst['layer'])} {worst['role']}: {pct(worst['clipped_share'])} of its blocks clip their max "
        f"element, {pct(worst['flushed_share'], 2)} of its nonzero entries flushed to zero")
    return (f"{code(precision)}: {head}; at most {pct(t['flushed_share'].max(), 2)} flushed in any role and layer; "
            f"block scales span 2^{_exp(lo)} to 2^{_exp(hi)}.")


def block_section(doc: Document, rs: RunSet) -> None:
    """The section (nothing when no run recorded block statistics)."""
    blocks = getattr(rs, "blocks", None)
    if blocks is None or blocks.empty:
        return
    table = block_table(blocks)
    if table.empty:
        return
    doc.h(1, "Block scaling: clipped blocks, flushed entries, scale exponents")
    for prec, t in table.groupby("precision", sort=True):
        doc.p(block_reading(table, prec))
        shown = t.head(MAX_ROWS)
        rows = [[code(r["role"]), code(r["layer"]), str(r["runs"]), f"{r['blocks']:.0f}",
                 pct(r["clipped_share"]), pct(r["flushed_share"], 2),
                 f"{_exp(r['scale_exp_lo'])} .. {_exp(r['scale_exp_hi'])}"] for _, r in shown.iterrows()]
        more = f" {len(t) - len(shown)} more rows not shown." if len(t) > len(shown) else ""
        doc.table(["role", "layer", "runs", "blocks cast", "clipped blocks", "flushed to zero",
                   "scale exponents"], rows, caption=(
            f"{code(prec)}: every Linear's block casts (both copies of a role, every logging step and run), "
            "worst first. Clipped: blocks whose max element saturates the element format; flushed: nonzero "
            "entries cast to zero; both weighted by the blocks cast. Scale exponents: the lowest and highest "
            f"power of two among the block scales.{more}"))
