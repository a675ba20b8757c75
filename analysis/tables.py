"""Grouped tables: per-strategy summaries with intervals, unpaired comparisons against ``native``,
tiered rankings.

Everything here works on the ``runs`` table of :func:`analysis.load.load_runs` and is grouped by
``workload × precision × strategy`` — the unit of comparison (a strategy is only ever compared
with another strategy on the same workload at the same precision). Runs whose identity is
unknown (no strategy, precision or workload) form groups of their own (shown as ``?``) and are
never compared with ``native``; the report lists them.

For the final eval loss and the time to target (``diverged_loses`` of their
:class:`~analysis.metrics.Metric`), a **diverged** run has no meaningful value: it is left out of
means, IQMs, their intervals and Welch's test, but enters the rank-based statistics
(Mann–Whitney, probability of improvement) and the pairing by seed as ``+inf`` — a diverged run
loses to every run that finished. The time to target of a run that never reached the target is
``+inf`` too (``inf_loses``): left out of means, it loses its seed the same way
(:mod:`analysis.targets`). Runs of any other status (failed,
incomplete, stalled, …) enter no statistic. The paired (by seed) comparisons are in
:mod:`analysis.paired`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from analysis.metrics import METRICS, PRIMARY, Metric, metric
from analysis.paired import PAIRED_COLUMNS, holm, paired_stats, reading
from analysis.records import STATUSES
from analysis.stats import (LEVEL, N_BOOT, SEED, bootstrap_ci, iqm, mann_whitney,
                            prob_improvement, prob_improvement_ci, welch_test)
from analysis.targets import REFERENCE_PRECISION, REFERENCE_STRATEGY
from analysis.words import TIMING

__all__ = ["BASELINE", "CELL_KEYS", "COMPARE_COLUMNS", "GROUP_KEYS", "compare_to_baseline",
           "compare_to_reference", "identified", "metric_values", "rank_strategies", "summarize"]

GROUP_KEYS = ["workload", "precision", "strategy"]
CELL_KEYS = ["workload", "precision"]
BASELINE = "native"


def identified(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs whose workload, precision and strategy are known (the others enter no group)."""
    if runs.empty:
        return runs
    return runs.dropna(subset=GROUP_KEYS)


def metric_values(group: pd.DataFrame, column: str, *, for_ranks: bool = False) -> np.ndarray:
    """Per-run values of ``column`` that enter the statistics (see the module docstring).

    Finite values of completed runs; with ``for_ranks``, ``+inf`` for each diverged run of a
    ``diverged_loses`` metric and each completed run's ``+inf`` of an ``inf_loses`` one
    (:class:`~analysis.metrics.Metric`).
    """
    if column not in group:
        return np.array([], dtype=float)
    m = metric(column)
    done = group[group["status"] == "completed"]
    vals = pd.to_numeric(done[column], errors="coerce").to_numpy(dtype=float)
    n_inf = int(np.sum(vals == np.inf)) if m.inf_loses else 0
    vals = vals[np.isfinite(vals)]
    if for_ranks:
        n_inf += int((group["status"] == "diverged").sum()) if m.diverged_loses else 0
        vals = np.concatenate([vals, np.full(n_inf, np.inf)])
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
        if "primary" in group:  # the workload's primary metric by name (one per workload)
            named = group["primary"].dropna()
            row["primary"] = str(named.mode().iloc[0]) if len(named) else None
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


COMPARE_COLUMNS = ["workload", "precision", "strategy", "baseline", "metric", *PAIRED_COLUMNS,
                   "reading", "n", "n_base", "mean", "base_mean", "diff", "welch_t", "welch_p",
                   "mwu_u", "mwu_p", "poi", "poi_lo", "poi_hi"]


def compare_to_baseline(runs: pd.DataFrame, baseline: str = BASELINE,
                        metrics: Sequence[Metric] = METRICS, *, n_boot: int = N_BOOT,
                        level: float = LEVEL, seed: int = SEED) -> pd.DataFrame:
    """Every non-baseline strategy against ``baseline`` within each workload × precision.

    One row per (workload, precision, strategy, metric). Primary, paired by seed
    (:mod:`analysis.paired`): ``n_pairs``, the mean per-seed difference ``paired_diff`` (negative
    is better) with its interval, paired-t (raw and Holm-adjusted) and Wilcoxon p-values,
    ``p_better`` with its interval, and the ``reading``. Secondary, unpaired: ``n``/``n_base``
    (values used by the rank statistics), means and ``diff = mean - base_mean``, Welch
    ``t``/``welch_p``, Mann–Whitney ``mwu_u``/``mwu_p``, probability of improvement ``poi`` with
    its bootstrap interval. Workload×precision cells without the baseline produce no rows.
    """
    pairs = []
    for (workload, precision), cell in identified(runs).groupby(CELL_KEYS, sort=True):
        base = cell[cell["strategy"] == baseline]
        pairs += [((workload, precision, strategy), group, base)
                  for strategy, group in cell.groupby("strategy", sort=True)
                  if strategy != baseline and not base.empty]
    return _compare_all(pairs, baseline, metrics, n_boot=n_boot, level=level, seed=seed)


def compare_to_reference(runs: pd.DataFrame, metrics: Sequence[Metric] = METRICS[:1], *,
                         n_boot: int = N_BOOT, level: float = LEVEL, seed: int = SEED
                         ) -> pd.DataFrame:
    """Every strategy at a reduced precision against the fp32 reference of the same workload
    (strategy ``none`` at ``fp32``, paired by seed): the columns of :func:`compare_to_baseline`
    with ``baseline`` = ``"fp32"``; by default for the primary metric only (the loss gap)."""
    pairs = []
    for workload, wl in identified(runs).groupby("workload", sort=True):
        ref = wl[(wl["precision"] == REFERENCE_PRECISION) & (wl["strategy"] == REFERENCE_STRATEGY)]
        low = wl[wl["precision"] != REFERENCE_PRECISION]
        pairs += [((workload, precision, strategy), group, ref) for (precision, strategy), group
                  in low.groupby(["precision", "strategy"], sort=True) if not ref.empty]
    return _compare_all(pairs, REFERENCE_PRECISION, metrics, n_boot=n_boot, level=level,
                        seed=seed)


def _by_seed(group: pd.DataFrame, column: str) -> pd.Series:
    """One value per seed for pairing: completed runs' finite values, ``+inf`` where the
    metric says a run loses (:class:`~analysis.metrics.Metric`), the mean where a seed ran more
    than once."""
    m = metric(column)
    vals = pd.to_numeric(group[column], errors="coerce") if column in group else \
        pd.Series(np.nan, index=group.index)
    completed = group["status"] == "completed"
    done = completed & (np.isfinite(vals) | ((vals == np.inf) & m.inf_loses))
    vals = vals.where(done, np.inf if m.diverged_loses else np.nan)
    vals = vals.where(done | (group["status"] == "diverged"), np.nan)
    with np.errstate(all="ignore"):
        return vals.groupby(group["seed"]).mean().dropna()


def _compare(group: pd.DataFrame, base: pd.DataFrame, column: str, *, n_boot: int,
             level: float, seed: int) -> dict[str, object]:
    """Paired (by seed) and unpaired statistics of one strategy's runs against a baseline's."""
    x, y = _by_seed(group, column), _by_seed(base, column)
    seeds = x.index.intersection(y.index)
    out: dict[str, object] = paired_stats(x[seeds].to_numpy(), y[seeds].to_numpy(),
                                          n_boot=n_boot, level=level, seed=seed)
    x_mean, y_mean = metric_values(group, column), metric_values(base, column)
    x_rank = metric_values(group, column, for_ranks=True)
    y_rank = metric_values(base, column, for_ranks=True)
    out["welch_t"], out["welch_p"] = welch_test(x_mean, y_mean)
    out["mwu_u"], out["mwu_p"] = mann_whitney(x_rank, y_rank)
    out["poi_lo"], out["poi_hi"] = prob_improvement_ci(x_rank, y_rank, n_boot=n_boot,
                                                       level=level, seed=seed)
    out["poi"] = prob_improvement(x_rank, y_rank)
    out["mean"], out["base_mean"] = _mean(x_mean), _mean(y_mean)
    out["diff"] = out["mean"] - out["base_mean"]
    out["n"], out["n_base"] = int(x_rank.size), int(y_rank.size)
    return out


def _compare_all(pairs: list[tuple[tuple[str, str, str], pd.DataFrame, pd.DataFrame]],
                 baseline: str, metrics: Sequence[Metric], **kw: object) -> pd.DataFrame:
    """The comparison table for ``((workload, precision, strategy), runs, baseline runs)``
    pairs, with Holm's adjustment over each family (the strategies compared with one baseline
    on one workload, precision and metric) and each row's reading (:data:`TIMING` for a
    wall-clock metric: machine load, not the strategy, moves it between runs)."""
    rows = [dict(workload=w, precision=p, strategy=s, baseline=baseline, metric=m.column,
                 **_compare(group, base, m.column, **kw))
            for (w, p, s), group, base in pairs for m in metrics]
    df = pd.DataFrame(rows, columns=COMPARE_COLUMNS)
    if df.empty:
        return df
    family = ["workload", "precision", "baseline", "metric"]
    df["paired_t_p_holm"] = df.groupby(family, sort=False)["paired_t_p"].transform(
        lambda p: holm(p.to_numpy(dtype=float)))
    df["reading"] = [TIMING if metric(r["metric"]).timing else reading(r, metric(r["metric"]).negligible)
                     for r in df.to_dict("records")]
    return df


def rank_strategies(summary: pd.DataFrame, metric: str = PRIMARY, estimate: str = "mean"
                    ) -> pd.DataFrame:
    """Rank strategies within each workload × precision, with ties where intervals overlap.

    Order: first by the fraction of runs that diverged (a strategy that diverged in any seed
    ranks below every strategy that did not), then by the point ``estimate`` of ``metric``.
    Walking down that order, a strategy shares the rank of the current tier's leader when it
    has the same divergence fraction and its interval overlaps the leader's; otherwise it
    starts a new tier whose rank is its 1-based position (competition ranking: 1, 1, 3).
    Strategies with no finite value, and groups whose workload, precision or strategy is
    unknown, get no rank (``<NA>``) and sort last. Returns the summary's
    key columns plus ``rank``, ``tied_with`` (other members of the tier) and ``diverged_frac``.
    """
    est, lo, hi = f"{metric}_{estimate}", f"{metric}_{estimate}_lo", f"{metric}_{estimate}_hi"
    out = []
    for (workload, precision), cell in summary.groupby(CELL_KEYS, dropna=False, sort=True):
        cell = cell.copy()
        denom = (cell["n_completed"] + cell["n_diverged"]).replace(0, np.nan)
        cell["diverged_frac"] = (cell["n_diverged"] / denom).fillna(1.0)
        # A group whose identity is incomplete (its runs are "not compared") is never ranked.
        cell["_unknown"] = cell[GROUP_KEYS].isna().any(axis=1)
        cell["_est"] = cell[est].mask(cell["_unknown"]).fillna(np.inf)
        cell = cell.sort_values(["_unknown", "diverged_frac", "_est", "strategy"]).reset_index(drop=True)
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
