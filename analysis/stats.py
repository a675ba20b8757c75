"""Interval estimates, comparisons against the ``native`` baseline, and tiered rankings.

Everything here works on the per-run table of :func:`analysis.load.load_runs` and is grouped by
``workload × precision × strategy`` — the unit of comparison (a strategy is only ever compared
with another strategy on the same workload at the same precision).

Estimators (all over seeds, i.e. one value per run):

* **mean** and **interquartile mean** ``IQM = trim_mean(x, 0.25)`` (the mean of the middle 50 %
  of runs, robust to one bad seed; Agarwal et al., *Deep RL at the Edge of the Statistical
  Precipice*, NeurIPS 2021 — google-research/rliable). With fewer than 4 runs nothing is trimmed
  and the IQM equals the mean.
* **95 % percentile bootstrap intervals**: resample the runs of a group with replacement
  ``n_boot`` times (fixed RNG seed, so a report is reproducible), take the statistic of each
  resample, and report the 2.5 % and 97.5 % quantiles (Efron & Tibshirani 1993, §13.3).
  The percentile bootstrap cannot reach beyond the observed values and ignores the
  ``n/(n-1)`` variance factor, so it **under-covers for small n**: with 3 seeds the nominal 95 %
  interval of a normal mean covers the truth only about 3 times in 4 (≈ 77 % over 400 draws,
  checked in ``tests/analysis/test_stats.py``); at n = 20 it is close to nominal (≈ 93 %). Read 3-seed intervals as
  "the spread of what we saw", not as a guarantee.

Comparisons of each strategy X with the baseline Y (``native``) on the same workload×precision:

* Welch's t-test (unequal variances) — on the finite values of completed runs;
* Mann–Whitney U (two-sided, exact when there are no ties) — rank-based. With 3 vs 3 runs the
  smallest attainable two-sided p-value is 0.1, so it can never reach 0.05;
* probability of improvement ``P(X < Y) = mean over all pairs of [x < y] + ½[x = y]`` (lower is
  better for every metric here; rliable's ``probability_of_improvement``), with a percentile
  bootstrap interval resampling X and Y independently.

For the primary metric (final eval loss), a **diverged** run has no meaningful final loss: it is
left out of means, IQMs, their intervals and Welch's test, but enters the rank-based statistics
(Mann–Whitney, probability of improvement) as ``+inf`` — a diverged run loses to every run that
finished. Failed (exception) and incomplete runs enter no statistic; the report lists them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

#: Default bootstrap resamples and seed (fixed: a report regenerated from the same runs is identical).
N_BOOT = 2000
SEED = 0
LEVEL = 0.95
GROUP_KEYS = ["workload", "precision", "strategy"]
BASELINE = "native"


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


# --------------------------------------------------------------------------------------------
# Point estimates and bootstrap intervals
# --------------------------------------------------------------------------------------------

def iqm(x: Sequence[float] | np.ndarray, axis: int | None = None) -> float | np.ndarray:
    """Interquartile mean: ``scipy.stats.trim_mean(x, 0.25)`` (rliable's IQM)."""
    return sps.trim_mean(np.asarray(x, dtype=float), 0.25, axis=axis)


def _mean(x: np.ndarray, axis: int | None = None) -> float | np.ndarray:
    return np.mean(x, axis=axis)


STATISTICS: dict[str, Callable[..., float | np.ndarray]] = {"mean": _mean, "iqm": iqm}


def bootstrap_ci(x: Sequence[float] | np.ndarray, statistic: str = "mean", *,
                 n_boot: int = N_BOOT, level: float = LEVEL, seed: int = SEED
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval ``(lo, hi)`` of ``statistic`` (``"mean"`` or ``"iqm"``).

    Resamples ``x`` with replacement ``n_boot`` times, computes the statistic of each resample,
    and returns its ``(1-level)/2`` and ``(1+level)/2`` quantiles. Returns ``(nan, nan)`` for
    fewer than 2 finite values (no spread to resample).
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    arr = np.asarray(x, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    samples = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))]
    values = STATISTICS[statistic](samples, axis=1)
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def prob_improvement(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """``P(X < Y) + ½ P(X = Y)`` over all pairs: how often X beats Y when lower is better.

    ``+inf`` values are allowed (a diverged run). NaN for an empty side.
    """
    a = np.asarray(x, dtype=float)[:, None]
    b = np.asarray(y, dtype=float)[None, :]
    if a.size == 0 or b.size == 0:
        return float("nan")
    return float(np.mean((a < b) + 0.5 * (a == b)))


def prob_improvement_ci(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, *,
                        n_boot: int = N_BOOT, level: float = LEVEL, seed: int = SEED
                        ) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`prob_improvement`, resampling X and Y independently
    (stratified by side, as rliable does). ``(nan, nan)`` when either side has < 2 runs."""
    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    if a.size < 2 or b.size < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    xa = a[rng.integers(0, a.size, size=(n_boot, a.size))][:, :, None]
    yb = b[rng.integers(0, b.size, size=(n_boot, b.size))][:, None, :]
    values = np.mean((xa < yb) + 0.5 * (xa == yb), axis=(1, 2))
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def welch_test(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Welch's unequal-variance t-test ``(t, p)`` (two-sided); NaN when a side has < 2 values
    or both are constant."""
    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    if a.size < 2 or b.size < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return (float("nan"), float("nan"))
    with warnings.catch_warnings():
        # nearly identical samples: scipy warns about precision loss and returns p ≈ 1, which
        # is the right reading; the warning would only alarm the report's reader
        warnings.simplefilter("ignore", RuntimeWarning)
        res = sps.ttest_ind(a, b, equal_var=False)
    return (float(res.statistic), float(res.pvalue))


def mann_whitney(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann–Whitney U ``(U of x, p)``; exact for small samples without ties.
    NaN when a side is empty or all values are identical."""
    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    if a.size == 0 or b.size == 0:
        return (float("nan"), float("nan"))
    both = np.concatenate([a, b])
    if np.all(both == both[0]):
        return (float(a.size * b.size / 2), 1.0)
    res = sps.mannwhitneyu(a, b, alternative="two-sided", method="auto")
    return (float(res.statistic), float(res.pvalue))


# --------------------------------------------------------------------------------------------
# Grouped tables
# --------------------------------------------------------------------------------------------

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
    counts = group["status"].value_counts()
    out = {f"n_{s}": int(counts.get(s, 0)) for s in
           ("completed", "diverged", "failed", "incomplete")}
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
            row[f"{c}_mean"] = float(np.mean(v)) if v.size else float("nan")
            row[f"{c}_mean_lo"], row[f"{c}_mean_hi"] = bootstrap_ci(
                v, "mean", n_boot=n_boot, level=level, seed=seed)
            row[f"{c}_iqm"] = float(iqm(v)) if v.size else float("nan")
            row[f"{c}_iqm_lo"], row[f"{c}_iqm_hi"] = bootstrap_ci(
                v, "iqm", n_boot=n_boot, level=level, seed=seed)
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
    for (workload, precision), cell in runs.groupby(["workload", "precision"], dropna=False,
                                                     sort=True):
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
                mean_x = float(np.mean(x_mean)) if x_mean.size else float("nan")
                mean_y = float(np.mean(y_mean)) if y_mean.size else float("nan")
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
    for (workload, precision), cell in summary.groupby(["workload", "precision"], dropna=False,
                                                       sort=True):
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
        cell["tied_with"] = [
            ", ".join(s for s, r in zip(cell["strategy"], ranks) if r == rank and s != name)
            for name, rank in zip(cell["strategy"], ranks)
        ]
        out.append(cell[["workload", "precision", "strategy", "rank", "tied_with",
                         "diverged_frac", est, lo, hi]])
    if not out:
        return pd.DataFrame(columns=["workload", "precision", "strategy", "rank", "tied_with",
                                     "diverged_frac", est, lo, hi])
    return pd.concat(out, ignore_index=True)


def _overlap(a: pd.Series, b: pd.Series, est: str, lo: str, hi: str) -> bool:
    """Whether the intervals of rows ``a`` and ``b`` overlap (a missing interval is the point)."""
    a_lo = a[lo] if np.isfinite(a[lo]) else a[est]
    a_hi = a[hi] if np.isfinite(a[hi]) else a[est]
    b_lo = b[lo] if np.isfinite(b[lo]) else b[est]
    b_hi = b[hi] if np.isfinite(b[hi]) else b[est]
    return bool(a_lo <= b_hi and b_lo <= a_hi)
