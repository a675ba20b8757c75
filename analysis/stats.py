"""Estimators and tests over seeds (one value per run), on scipy.

* **mean** and **interquartile mean** ``IQM = trim_mean(x, 0.25)`` (the mean of the middle 50 %
  of runs, robust to one bad seed; Agarwal et al., *Deep RL at the Edge of the Statistical
  Precipice*, NeurIPS 2021 — google-research/rliable). With fewer than 4 runs nothing is trimmed
  and the IQM equals the mean.
* **95 % bootstrap intervals** from ``scipy.stats.bootstrap`` with a fixed RNG seed (a report
  regenerated from the same runs is identical): **BCa** (bias-corrected and accelerated; Efron &
  Tibshirani 1993, §14.3) for the mean and the IQM — it corrects the skew of bounded or
  heavy-tailed metrics (skipped steps, overhead fractions) that the plain percentile interval
  ignores (measured on lognormal data: 71 % vs 69 % coverage at n = 5, 86 % vs 83 % at n = 20) —
  and the **percentile** interval for probabilities (P(improvement), bounded with many ties, where
  BCa's jackknife acceleration is undefined). No bootstrap fixes the small-n variance: with 3
  seeds the nominal 95 % interval of a normal mean covers the truth only about 7 times in 10,
  with 20 about 93 % (checked in ``tests/analysis/test_stats.py``). Read 3-seed intervals as "the
  spread of what we saw", not as a guarantee.
* Degenerate samples never warn: fewer than 2 finite values give ``(nan, nan)``; a sample whose
  every resample has the same statistic (all values equal) gives the point ``(v, v)``.
* Unpaired tests of X against a baseline Y: Welch's t-test; Mann–Whitney U (two-sided, exact
  without ties — with 3 vs 3 runs its smallest p is 0.1); probability of improvement
  ``P(X < Y) = mean over pairs of [x < y] + ½[x = y]`` (lower is better; rliable), with a
  percentile bootstrap interval resampling X and Y independently. ``+inf`` (a diverged run) is
  allowed in the rank-based statistics.
* **Clopper–Pearson** exact interval of a binomial proportion ``k / n``
  (:func:`clopper_pearson`): the paired reading's P(better) and a reproduced claim's rate.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import numpy as np
from scipy import stats as sps

__all__ = ["Array", "CHUNK", "LEVEL", "N_BOOT", "SEED", "STATISTICS", "bootstrap_ci",
           "clopper_pearson", "iqm", "mann_whitney", "prob_improvement", "prob_improvement_ci",
           "prob_improvement_rows", "welch_test"]

#: Default bootstrap resamples and seed (fixed: a report regenerated from the same runs is
#: identical).
N_BOOT = 2000
SEED = 0
LEVEL = 0.95

Array = Sequence[float] | np.ndarray


def iqm(x: Array, axis: int | None = None) -> float | np.ndarray:
    """Interquartile mean: ``scipy.stats.trim_mean(x, 0.25)`` (rliable's IQM)."""
    return sps.trim_mean(np.asarray(x, dtype=float), 0.25, axis=axis)


def _mean(x: np.ndarray, axis: int | None = None) -> float | np.ndarray:
    return np.mean(x, axis=axis)


STATISTICS: dict[str, Callable[..., float | np.ndarray]] = {"mean": _mean, "iqm": iqm}


def _check(level: float, n_boot: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")


def _interval(data: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], method: str,
              *, n_boot: int, level: float, seed: int, paired: bool = False
              ) -> tuple[float, float]:
    """``scipy.stats.bootstrap`` interval; the point ``(v, v)`` when the bootstrap distribution
    has no spread; a BCa interval that scipy cannot form falls back to the percentile one."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # degenerate data and precision loss: handled below
        res = sps.bootstrap(data, statistic, n_resamples=n_boot, confidence_level=level,
                            method=method, paired=paired, vectorized=True,
                            rng=np.random.default_rng(seed))
        dist = res.bootstrap_distribution
        if np.all(dist == dist.flat[0]) or not np.isfinite(dist).any():
            v = float(dist.flat[0])
            return (v, v)
        lo, hi = res.confidence_interval
        if not (np.isfinite(lo) and np.isfinite(hi)) and method != "percentile":
            return _interval(data, statistic, "percentile", n_boot=n_boot, level=level,
                             seed=seed, paired=paired)
    return (float(lo), float(hi))


def bootstrap_ci(x: Array, statistic: str = "mean", *, n_boot: int = N_BOOT,
                 level: float = LEVEL, seed: int = SEED, method: str = "BCa"
                 ) -> tuple[float, float]:
    """95 % bootstrap interval ``(lo, hi)`` of ``statistic`` (``"mean"`` or ``"iqm"``) over the
    finite values of ``x`` (BCa by default; see the module docstring). ``(nan, nan)`` for fewer
    than 2 finite values."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    _check(level, n_boot)
    arr = np.asarray(x, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < 2:
        return (float("nan"), float("nan"))
    if np.all(arr == arr[0]):  # a constant sample: every statistic is that constant
        return (float(arr[0]), float(arr[0]))
    return _interval((arr,), STATISTICS[statistic], method, n_boot=n_boot, level=level,
                     seed=seed)


#: Most values the statistic of :func:`prob_improvement_ci` handles at once (rows of
#: bootstrap resamples × runs of both sides): its memory is O(this), whatever the seed count.
CHUNK = 2**18


def _poi(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """``P(X < Y) + ½ P(X = Y)`` along ``axis``, for each resample of a batch (scipy's
    vectorized statistic); NaN never wins nor ties.

    Counted by sorting, not by the ``n_x × n_y`` table of all pairs: per row of ``x`` and ``y``,
    ``L = #{(i, j): x_i < y_j}`` is the number of x's before each y_j in a stable sort of
    ``[y, x]`` (ties put y first) and ``L + E`` (``E`` = equal pairs) the same in a sort of
    ``[x, y]``; the result ``(L + (L + E)) / 2 / (n_x n_y)`` equals the mean over all pairs
    exactly (sums of halves below 2^52 are exact). Rows are processed :data:`CHUNK` values at a
    time, so memory is O(CHUNK) rather than O(n_boot · n_x · n_y).
    """
    a = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    b = np.moveaxis(np.asarray(y, dtype=float), axis, -1)
    lead = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    nx, ny = a.shape[-1], b.shape[-1]
    a = np.broadcast_to(a, (*lead, nx)).reshape(-1, nx)
    b = np.broadcast_to(b, (*lead, ny)).reshape(-1, ny)
    out = np.empty(a.shape[0])
    step = max(1, CHUNK // max(nx + ny, 1))
    for start in range(0, a.shape[0], step):
        rows = slice(start, start + step)
        twice = _x_below_y(a[rows], b[rows], y_first=True)
        twice += _x_below_y(a[rows], b[rows], y_first=False)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[rows] = (twice / 2) / (nx * ny)
    return out.reshape(lead)[()]


def _x_below_y(a: np.ndarray, b: np.ndarray, *, y_first: bool) -> np.ndarray:
    """Per row: the number of pairs with ``x_i < y_j`` (``y_first``) or ``x_i <= y_j``; a
    NaN y counts none (NaN sorts last, so a NaN x is never below a y that is not NaN)."""
    x_mark, y_mark = np.ones(a.shape[1], dtype=np.int64), np.zeros(b.shape[1], dtype=np.int64)
    both = np.concatenate([b, a] if y_first else [a, b], axis=1)
    is_x = np.concatenate([y_mark, x_mark] if y_first else [x_mark, y_mark])
    order = np.argsort(both, axis=1, kind="stable")
    x_sorted = is_x[order]
    x_before = np.cumsum(x_sorted, axis=1) - x_sorted
    counted = (x_sorted == 0) & ~np.isnan(np.take_along_axis(both, order, axis=1))
    return np.sum(np.where(counted, x_before, 0), axis=1)


def prob_improvement_rows(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """:func:`prob_improvement` along ``axis`` for every row of a batch (leading axes broadcast),
    in bounded memory (:func:`_poi`)."""
    return _poi(x, y, axis=axis)


def prob_improvement(x: Array, y: Array) -> float:
    """``P(X < Y) + ½ P(X = Y)`` over all pairs: how often X beats Y when lower is better.

    ``+inf`` values are allowed (a diverged run). NaN for an empty side.
    """
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size == 0 or b.size == 0:
        return float("nan")
    return float(_poi(a, b))


def prob_improvement_ci(x: Array, y: Array, *, n_boot: int = N_BOOT, level: float = LEVEL,
                        seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`prob_improvement`, resampling X and Y
    independently (stratified by side, as rliable does). ``(nan, nan)`` when either side has
    fewer than 2 runs."""
    _check(level, n_boot)
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size < 2 or b.size < 2:
        return (float("nan"), float("nan"))
    return _interval((a, b), _poi, "percentile", n_boot=n_boot, level=level, seed=seed)


def welch_test(x: Array, y: Array) -> tuple[float, float]:
    """Welch's unequal-variance t-test ``(t, p)`` (two-sided); NaN when a side has < 2 values
    or both are constant."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size < 2 or b.size < 2 or (np.all(a == a[0]) and np.all(b == b[0])):
        return (float("nan"), float("nan"))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # nearly identical samples: scipy warns about precision loss and returns p ≈ 1, which
        # is the right reading; the warning would only alarm the report's reader
        warnings.simplefilter("ignore", RuntimeWarning)
        res = sps.ttest_ind(a, b, equal_var=False)
    return (float(res.statistic), float(res.pvalue))


def mann_whitney(x: Array, y: Array) -> tuple[float, float]:
    """Two-sided Mann–Whitney U ``(U of x, p)``; exact for small samples without ties.
    NaN when a side is empty; ``p = 1`` when all values are identical."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size == 0 or b.size == 0:
        return (float("nan"), float("nan"))
    both = np.concatenate([a, b])
    if np.all(both == both[0]):
        return (float(a.size * b.size / 2), 1.0)
    res = sps.mannwhitneyu(a, b, alternative="two-sided", method="auto")
    return (float(res.statistic), float(res.pvalue))


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact two-sided ``level`` interval ``(lo, hi)`` of a binomial proportion from ``k``
    successes in ``n`` trials (Clopper & Pearson, *Biometrika* 26, 1934): the ``p`` where
    ``P(X ≥ k | p) = α/2`` and where ``P(X ≤ k | p) = α/2``, ``α = 1 − level`` — in closed form
    the beta quantiles ``B(α/2; k, n−k+1)`` and ``B(1−α/2; k+1, n−k)``; ``lo = 0`` at ``k = 0``,
    ``hi = 1`` at ``k = n``. Computed by ``scipy.stats.binomtest(k, n).proportion_ci(
    method="exact")`` (root finding on the binomial tails)."""
    ci = sps.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return (float(ci.low), float(ci.high))
