"""Paired statistics: runs of one seed share init and data order, so a strategy is compared with
its baseline seed by seed (issue 12, item 2).

For one strategy X and one baseline B (``native`` at the same workload and precision, or the fp32
reference run — strategy ``none`` at ``fp32`` — of the same workload), over the seeds both ran:

* per-seed differences ``d_s = x_s - b_s`` (lower is better, so ``d < 0`` favours X);
* the mean difference with a paired bootstrap interval (``scipy.stats.bootstrap`` resampling
  seeds, BCa, fixed seed; :func:`analysis.stats.bootstrap_ci`);
* the paired t-test and the exact Wilcoxon signed-rank test of ``d`` (two-sided);
* ``P(better)`` = fraction of seeds where X is lower (ties ½), with a Clopper–Pearson interval
  (:func:`analysis.stats.clopper_pearson`; ties counted against X for the lower end, for X for
  the upper).

A diverged run (primary metric only) has no final value: a seed where one side diverged counts as
a loss for that side in ``P(better)`` and in the Wilcoxon ranks (as a difference larger than any
finite one), and is left out of the mean difference and the t-test; other statuses are left out.

**Reading** (:func:`reading`; the words of the report and of ``comparisons.csv``, defined in
:mod:`analysis.words`):

* **clearly better / clearly worse** — all three hold: (1) the paired t-test's p-value, Holm-
  adjusted over the strategies compared with the same baseline on the same workload, precision
  and metric (:func:`holm`), is below 0.05; (2) the Wilcoxon signed-rank test agrees as far as
  the seed count allows: p < 0.05, or, with 5 or fewer seeds where the smallest attainable
  two-sided p is 2/2^n ≥ 0.0625 (2/32 with 5 seeds, 2/64 = 0.031 with 6), every seed moves the
  same way (p at that minimum); (3) the interval of the mean difference excludes 0;
* **better / worse in these seeds, but too few seeds** — not clearly, but the interval of the mean
  difference excludes 0 (or, when only diverged seeds differ, the interval of P(better) excludes
  ½), and most seeds moved that way;
* **negligible difference** — one of the above, but the whole interval of the mean difference lies
  inside ``±negligible``, the metric's smallest effect worth naming
  (:attr:`analysis.metrics.Metric.negligible`): deterministic runs can make a difference of
  1e-7 in 1 − cosine statistically certain, and it must not name a winner;
* **no detectable difference** — otherwise; **not comparable** — fewer than 2 paired seeds.

The t-test makes the call possible at 3–5 seeds; the Wilcoxon condition keeps one outlying seed
from carrying it; Holm keeps the chance of any false "clearly" among one comparison's strategies
at or below 5 % (``tests/analysis/test_paired.py`` simulates comparisons with no true effect).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
from scipy import stats as sps

from analysis.stats import LEVEL, N_BOOT, SEED, bootstrap_ci, clopper_pearson
from analysis.words import (BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE, NEGLIGIBLE, NO_DIFFERENCE,
                            NOT_COMPARABLE, WORSE_FEW)

__all__ = ["ALPHA", "PAIRED_COLUMNS", "holm", "min_wilcoxon_p", "paired_stats", "reading"]

ALPHA = 0.05

PAIRED_COLUMNS = ["n_pairs", "paired_diff", "paired_diff_lo", "paired_diff_hi", "paired_t_p",
                  "paired_t_p_holm", "wilcoxon_p", "p_better", "p_better_lo", "p_better_hi"]


def paired_stats(x: Sequence[float], y: Sequence[float], *, n_boot: int = N_BOOT,
                 level: float = LEVEL, seed: int = SEED) -> dict[str, float]:
    """The paired columns (:data:`PAIRED_COLUMNS`, Holm left NaN) for per-seed values ``x`` of
    the strategy and ``y`` of the baseline, aligned by seed; ``+inf`` marks a diverged run."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = ~(np.isnan(a) | np.isnan(b)) & ~(np.isinf(a) & np.isinf(b))
    a, b = a[keep], b[keep]
    nan = float("nan")
    out = dict.fromkeys(PAIRED_COLUMNS, nan)
    out["n_pairs"] = int(a.size)
    if a.size == 0:
        return out
    with np.errstate(all="ignore"):
        d = a - b
    finite = d[np.isfinite(d)]
    better, ties = int(np.sum(a < b)), int(np.sum(a == b))
    out["p_better"] = (better + 0.5 * ties) / a.size
    out["p_better_lo"] = clopper_pearson(better, a.size)[0]
    out["p_better_hi"] = clopper_pearson(better + ties, a.size)[1]
    if finite.size:
        with np.errstate(all="ignore"):
            out["paired_diff"] = float(np.mean(finite))
    out["paired_diff_lo"], out["paired_diff_hi"] = bootstrap_ci(finite, "mean", n_boot=n_boot,
                                                                level=level, seed=seed)
    out["paired_t_p"] = _t_p(finite)
    out["wilcoxon_p"] = _wilcoxon_p(d)
    return out


def _t_p(d: np.ndarray) -> float:
    """Two-sided one-sample t-test of ``d`` against 0: NaN below 2 values; with no spread, 1 for
    all-zero differences and 0 for a constant nonzero one (the t statistic is infinite)."""
    if d.size < 2:
        return float("nan")
    if np.all(d == d[0]):
        return 1.0 if d[0] == 0 else 0.0
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(sps.ttest_1samp(d, 0.0).pvalue)
    return p if np.isfinite(p) else float("nan")


def _wilcoxon_p(d: np.ndarray) -> float:
    """Exact two-sided Wilcoxon signed-rank p of ``d`` (zeros dropped; ``±inf`` ranked above
    every finite difference); 1 when every difference is zero, NaN when there is none."""
    if d.size == 0:
        return float("nan")
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    finite = d[np.isfinite(d)]
    top = 2.0 * float(np.max(np.abs(finite))) + 1.0 if finite.size else 1.0
    d = np.where(np.isfinite(d), d, np.sign(d) * top)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        p = float(sps.wilcoxon(d, method="exact" if d.size <= 50 else "auto").pvalue)
    return p


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjustment of the p-values of one family (NaN entries stay NaN and do
    not count): ``p_(i) · (m - i + 1)``, made monotone, capped at 1 (Holm 1979)."""
    arr = np.asarray(p, dtype=float)
    out = np.full(arr.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(arr))
    m = idx.size
    if m == 0:
        return out
    order = idx[np.argsort(arr[idx], kind="stable")]
    adjusted = np.maximum.accumulate(arr[order] * (m - np.arange(m)))
    out[order] = np.minimum(adjusted, 1.0)
    return out


def min_wilcoxon_p(n: int) -> float:
    """Smallest two-sided exact Wilcoxon signed-rank p with ``n`` nonzero differences: 2/2^n."""
    return 2.0 / 2.0 ** n if n > 0 else 1.0


def reading(row: dict[str, float], negligible: float = 0.0) -> str:
    """The words for one paired comparison (the rule in the module docstring); ``row`` holds
    :data:`PAIRED_COLUMNS` with ``paired_t_p_holm`` filled in; ``negligible`` is the metric's
    smallest effect worth naming (0: every detected effect is named)."""
    n = row["n_pairs"]
    if not n or n < 2:
        return NOT_COMPARABLE
    lo, hi = row["paired_diff_lo"], row["paired_diff_hi"]
    p_better = row["p_better"]
    if np.isfinite(lo) and np.isfinite(hi):
        direction = -1 if hi < 0 else 1 if lo > 0 else 0
    else:  # no finite interval: only diverged seeds differ; read P(better)'s interval
        direction = (-1 if row["p_better_lo"] > 0.5 else 1 if row["p_better_hi"] < 0.5 else 0)
    if direction == 0 or (direction < 0) != (p_better > 0.5):
        return NO_DIFFERENCE
    if negligible > 0 and np.isfinite(lo) and np.isfinite(hi) and -negligible < lo and hi < negligible:
        return NEGLIGIBLE
    p_w = row["wilcoxon_p"]
    rank_agrees = np.isfinite(p_w) and (p_w < ALPHA or (min_wilcoxon_p(n) >= ALPHA
                                                        and p_w <= min_wilcoxon_p(n) + 1e-12))
    p_t = row["paired_t_p_holm"]
    if np.isfinite(p_t) and p_t < ALPHA and rank_agrees and np.isfinite(lo):
        return CLEARLY_BETTER if direction < 0 else CLEARLY_WORSE
    return BETTER_FEW if direction < 0 else WORSE_FEW
