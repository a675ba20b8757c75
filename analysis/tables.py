"""Grouped tables: per-strategy summaries with intervals, unpaired comparisons against ``native``,
tiered rankings.

Everything here works on the ``runs`` table of :func:`analysis.load.load_runs` and is grouped by
``workload × precision × strategy`` — the unit of comparison (a strategy is only ever compared
with another strategy on the same workload at the same precision). Runs whose identity is
unknown (no strategy, precision or workload) form groups of their own (shown as ``?``) and are
never compared with ``native``; the report lists them.

For the primary metric (final eval loss), a **diverged** run has no meaningful final loss: it is
left out of means, IQMs, their intervals and Welch's test, but enters the rank-based statistics
(Mann–Whitney, probability of improvement) as ``+inf`` — a diverged run loses to every run that
finished. Runs of any other status (failed, incomplete, stalled, …) enter no statistic.
The paired (by seed) comparisons are in :mod:`analysis.paired`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.runset import STATUSES
from analysis.stats import (LEVEL, N_BOOT, SEED, bootstrap_ci, iqm, mann_whitney,
                            prob_improvement, prob_improvement_ci, welch_test)

GROUP_KEYS = ["workload", "precision", "strategy"]
CELL_KEYS = ["workload", "precision"]
BASELINE = "native"
REFERENCE_PRECISION = "fp32"


@dataclass(frozen=True)
class Metric:
    """A per-run metric compared across strategies; lower is better for all of them."""

    column: str
    label: str
    description: str


#: The metrics the report compares, primary first.
METRICS: tuple[Metric, ...] = (
    Metric("final_eval_loss", "final eval loss",
           "validation loss at the end of training (primary metric)"),
    Metric("skipped_steps", "skipped steps",
           "optimizer steps skipped because of non-finite gradients"),
    Metric("strategy_overhead_frac", "strategy overhead",
           "mean per-step time in the strategy's scale/unscale/update, as a fraction of the step"),
    Metric("act_zero_frac_mean", "act-grad zero fraction",
           "fraction of activation-gradient elements that are exactly zero (underflow plus "
           "structural zeros such as ReLU), averaged over layers and logged steps"),
)
PRIMARY = METRICS[0].column


def identified(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs whose workload, precision and strategy are known (the others enter no group)."""
    if runs.empty:
        return runs
    return runs.dropna(subset=GROUP_KEYS)


def metric_values(group: pd.DataFrame, column: str, *, for_ranks: bool = False) -> np.ndarray:
    """Per-run values of ``column`` that enter the statistics (see the module docstring).

    Finite values of completed runs; with ``for_ranks`` and the primary metric, diverged runs
    are appended as ``+inf``.
    """
    if column not in group:
        return np.array([], dtype=float)
    done = group[group["status"] == "completed"]
    vals = pd.to_numeric(done[column], errors="coerce").to_numpy(dtype=float)
    vals = vals[np.isfinite(vals)]
    if for_ranks and column == PRIMARY:
        n_div = int((group["status"] == "diverged").sum())
        vals = np.concatenate([vals, np.full(n_div, np.inf)])
    return vals


def _status_counts(group: pd.DataFrame) -> dict[str, int]:
    """``n_<status>`` for the four usual statuses, ``n_other`` for any other (e.g. stalled)."""
    counts = group["status"].value_counts()
    out = {f"n_{s}": int(counts.get(s, 0)) for s in STATUSES}
    out["n_other"] = int(len(group)) - sum(out.values())
    out["n_runs"] = int(len(group))
    return out


def summarize(runs: pd.DataFrame, metrics: Sequence[Metric] = METRICS, *, n_boot: int = N_BOOT,
              level: float = LEVEL, seed: int = SEED) -> pd.DataFrame:
    """One row per workload × precision × strategy: run counts by status and, for each metric,
    ``n``, ``mean`` and ``iqm`` with their bootstrap intervals (``_lo``/``_hi``) and ``sd``."""
    rows = []
    for keys, group in runs.groupby(GROUP_KEYS, dropna=False, sort=True):
        row: dict[str, object] = dict(zip(GROUP_KEYS, keys))
        row.update(_status_counts(group))
        for m in metrics:
            v = metric_values(group, m.column)
            c = m.column
            row[f"{c}_n"] = int(v.size)
            row[f"{c}_mean"] = _mean(v)
            row[f"{c}_mean_lo"], row[f"{c}_mean_hi"] = bootstrap_ci(
                v, "mean", n_boot=n_boot, level=level, seed=seed)
            row[f"{c}_iqm"] = float(iqm(v)) if v.size else float("nan")
            row[f"{c}_iqm_lo"], row[f"{c}_iqm_hi"] = bootstrap_ci(
                v, "iqm", n_boot=n_boot, level=level, seed=seed)
            with np.errstate(all="ignore"):
                row[f"{c}_sd"] = float(np.std(v, ddof=1)) if v.size > 1 else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


COMPARE_COLUMNS = ["workload", "precision", "strategy", "baseline", "metric", "n", "n_base", "mean",
                   "base_mean", "diff", "welch_t", "welch_p", "mwu_u", "mwu_p", "poi", "poi_lo",
                   "poi_hi"]


def compare_to_baseline(runs: pd.DataFrame, baseline: str = BASELINE,
                        metrics: Sequence[Metric] = METRICS, *, n_boot: int = N_BOOT,
                        level: float = LEVEL, seed: int = SEED) -> pd.DataFrame:
    """Every non-baseline strategy against ``baseline`` within each workload × precision.

    One row per (workload, precision, strategy, metric): ``n``/``n_base`` (values used by the
    rank statistics), means and their difference ``diff = mean - base_mean`` (negative is
    better), Welch ``t``/``welch_p``, Mann–Whitney ``mwu_u``/``mwu_p``, and probability of
    improvement ``poi`` with its bootstrap interval. Workload×precision cells without the
    baseline produce no rows.
    """
    rows = []
    for (workload, precision), cell in identified(runs).groupby(CELL_KEYS, sort=True):
        base = cell[cell["strategy"] == baseline]
        if base.empty:
            continue
        for strategy, group in cell.groupby("strategy", sort=True):
            if strategy == baseline:
                continue
            for m in metrics:
                x_mean, y_mean = metric_values(group, m.column), metric_values(base, m.column)
                x_rank = metric_values(group, m.column, for_ranks=True)
                y_rank = metric_values(base, m.column, for_ranks=True)
                t, p_t = welch_test(x_mean, y_mean)
                u, p_u = mann_whitney(x_rank, y_rank)
                lo, hi = prob_improvement_ci(x_rank, y_rank, n_boot=n_boot, level=level,
                                             seed=seed)
                mean_x, mean_y = _mean(x_mean), _mean(y_mean)
                rows.append({
                    "workload": workload, "precision": precision, "strategy": strategy,
                    "baseline": baseline, "metric": m.column, "n": int(x_rank.size),
                    "n_base": int(y_rank.size), "mean": mean_x, "base_mean": mean_y,
                    "diff": mean_x - mean_y, "welch_t": t, "welch_p": p_t, "mwu_u": u,
                    "mwu_p": p_u, "poi": prob_improvement(x_rank, y_rank), "poi_lo": lo,
                    "poi_hi": hi,
                })
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS)


def rank_strategies(summary: pd.DataFrame, metric: str = PRIMARY, estimate: str = "mean"
                    ) -> pd.DataFrame:
    """Rank strategies within each workload × precision, with ties where intervals overlap.

    Order: first by the fraction of runs that diverged (a strategy that diverged in any seed
    ranks below every strategy that did not), then by the point ``estimate`` of ``metric``.
    Walking down that order, a strategy shares the rank of the current tier's leader when it
    has the same divergence fraction and its interval overlaps the leader's; otherwise it
    starts a new tier whose rank is its 1-based position (competition ranking: 1, 1, 3).
    Strategies with no finite value get no rank (``<NA>``) and sort last. Returns the summary's key columns plus
    ``rank``, ``tied_with`` (other members of the tier) and ``diverged_frac``.
    """
    est, lo, hi = f"{metric}_{estimate}", f"{metric}_{estimate}_lo", f"{metric}_{estimate}_hi"
    out = []
    for (workload, precision), cell in summary.groupby(CELL_KEYS, dropna=False, sort=True):
        cell = cell.copy()
        denom = (cell["n_completed"] + cell["n_diverged"]).replace(0, np.nan)
        cell["diverged_frac"] = (cell["n_diverged"] / denom).fillna(1.0)
        cell["_est"] = cell[est].fillna(np.inf)
        cell = cell.sort_values(["diverged_frac", "_est", "strategy"]).reset_index(drop=True)
        ranks: list[int] = []
        leader: pd.Series | None = None
        for pos, row in cell.iterrows():
            if (leader is not None and row["diverged_frac"] == leader["diverged_frac"]
                    and np.isfinite(row["_est"]) and np.isfinite(leader["_est"])
                    and _overlap(leader, row, est, lo, hi)):
                ranks.append(ranks[-1])
                continue
            leader = row
            ranks.append(int(pos) + 1)
        # A strategy with no finite value (every run failed/diverged/incomplete) is not ranked.
        cell["rank"] = pd.array([r if np.isfinite(e) else pd.NA for r, e in
                                 zip(ranks, cell["_est"])], dtype="Int64")
        names = ["?" if pd.isna(s) else str(s) for s in cell["strategy"]]
        cell["tied_with"] = [", ".join(s for j, (s, r) in enumerate(zip(names, ranks))
                                       if r == rank and j != i)
                             for i, rank in enumerate(ranks)]
        out.append(cell[["workload", "precision", "strategy", "rank", "tied_with",
                         "diverged_frac", est, lo, hi]])
    if not out:
        return pd.DataFrame(columns=["workload", "precision", "strategy", "rank", "tied_with",
                                     "diverged_frac", est, lo, hi])
    return pd.concat(out, ignore_index=True)


def _mean(v: np.ndarray) -> float:
    """Mean of finite values (NaN when empty; huge values may overflow to inf, silently)."""
    with np.errstate(all="ignore"):
        return float(np.mean(v)) if v.size else float("nan")


def _overlap(a: pd.Series, b: pd.Series, est: str, lo: str, hi: str) -> bool:
    """Whether the intervals of rows ``a`` and ``b`` overlap (a missing interval is the point)."""
    a_lo = a[lo] if np.isfinite(a[lo]) else a[est]
    a_hi = a[hi] if np.isfinite(a[hi]) else a[est]
    b_lo = b[lo] if np.isfinite(b[lo]) else b[est]
    b_hi = b[hi] if np.isfinite(b[hi]) else b[est]
    return bool(a_lo <= b_hi and b_lo <= a_hi)
