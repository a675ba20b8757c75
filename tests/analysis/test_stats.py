"""Statistics against ground truth: interval coverage, p-values, probability of improvement,
tiered ranking on runs with known differences."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis import stats
from analysis.load import load_runs
from analysis.metrics import PRIMARY
from analysis.stats import (bootstrap_ci, clopper_pearson, iqm, mann_whitney, prob_improvement,
                            prob_improvement_ci, welch_test)
from analysis.tables import compare_to_baseline, rank_strategies, summarize
from tests.analysis.synth import SweepSpec, write_sweep

REPO = Path(__file__).resolve().parents[2]


def _coverage(n: int, statistic: str, draws: int = 200) -> float:
    """Fraction of ``draws`` normal samples of size n whose 95 % interval covers the true value
    (mean = IQM = 1 for a symmetric distribution)."""
    rng = np.random.default_rng(2024)
    hits = 0
    for d in range(draws):
        x = rng.normal(1.0, 0.5, n)
        lo, hi = bootstrap_ci(x, statistic, n_boot=1000, seed=d)
        hits += lo <= 1.0 <= hi
    return hits / draws


@pytest.mark.parametrize("statistic", ["mean", "iqm"])
def test_bootstrap_interval_covers_at_about_the_nominal_rate(statistic):
    # 200 draws: binomial sd ≈ 1.7 points around the ≈ 93 % the percentile bootstrap gives at n=20
    assert 0.88 <= _coverage(20, statistic) <= 0.985


def test_bootstrap_interval_undercovers_with_three_seeds():
    """The documented caveat: with 3 runs the 95 % interval covers far less often."""
    cov = _coverage(3, "mean")
    assert 0.6 <= cov <= 0.88


def test_bootstrap_is_reproducible_and_validates():
    x = [0.1, 0.5, 0.2, 0.9]
    assert bootstrap_ci(x) == bootstrap_ci(x)
    lo, hi = bootstrap_ci(x)
    assert min(x) <= lo < np.mean(x) < hi <= max(x)
    assert np.isnan(bootstrap_ci([1.0])).all()
    with pytest.raises(ValueError, match="statistic must be one of"):
        bootstrap_ci(x, "median")
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_ci(x, level=95)


def test_iqm_is_the_mean_of_the_middle_half():
    x = np.array([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -50.0])
    middle = np.sort(x)[2:6]
    assert iqm(x) == pytest.approx(middle.mean())
    assert iqm([1.0, 2.0, 9.0]) == pytest.approx(4.0)  # below 4 runs nothing is trimmed


def test_p_values_large_for_identical_small_for_shifted():
    rng = np.random.default_rng(5)
    same_p, shift_p = [], []
    for _ in range(50):
        a, b = rng.normal(0, 1, 12), rng.normal(0, 1, 12)
        same_p.append((welch_test(a, b)[1], mann_whitney(a, b)[1]))
        shift_p.append((welch_test(a - 2.0, b)[1], mann_whitney(a - 2.0, b)[1]))
    same_p, shift_p = np.array(same_p), np.array(shift_p)
    # identical distributions: p is uniform — median near 0.5, rarely below 0.05
    assert np.all(np.median(same_p, axis=0) > 0.25)
    assert np.all((same_p < 0.05).mean(axis=0) <= 0.15)
    # a 2-sd shift with 12 vs 12 runs is detected essentially always
    assert np.all((shift_p < 0.01).mean(axis=0) >= 0.95)


def test_welch_and_mwu_match_scipy_and_handle_degenerate_input():
    a, b = [1.0, 2.0, 3.5], [2.0, 4.0, 6.0, 7.0]
    assert welch_test(a, b) == pytest.approx(tuple(sps.ttest_ind(a, b, equal_var=False)))
    assert mann_whitney(a, b) == pytest.approx(tuple(sps.mannwhitneyu(a, b)))
    assert np.isnan(welch_test([1.0], b)).all()
    assert mann_whitney([1.0, 1.0], [1.0, 1.0])[1] == 1.0
    # 3 vs 3 completely separated: the smallest two-sided exact p-value is 0.1
    assert mann_whitney([1, 2, 3], [4, 5, 6])[1] == pytest.approx(0.1)


def test_probability_of_improvement_is_the_normalised_u_statistic():
    rng = np.random.default_rng(3)
    x, y = rng.normal(0, 1, 7), rng.normal(0.5, 1, 9)
    u_y = sps.mannwhitneyu(y, x).statistic  # pairs with y > x, ties ½
    assert prob_improvement(x, y) == pytest.approx(u_y / (len(x) * len(y)))
    assert prob_improvement([1.0, 2.0], [1.0, 2.0]) == 0.5
    assert prob_improvement([0.1], [np.inf]) == 1.0  # a diverged baseline loses
    lo, hi = prob_improvement_ci(x, y)
    assert 0.0 <= lo <= prob_improvement(x, y) <= hi <= 1.0
    assert prob_improvement_ci([0.0, 0.1, 0.2], [1.0, 1.1, 1.2]) == (1.0, 1.0)


def _runs(values: dict[str, list[float]], diverged: dict[str, int] | None = None) -> pd.DataFrame:
    rows = []
    for strategy, vals in values.items():
        for seed, v in enumerate(vals):
            rows.append({"workload": "w", "precision": "fp16", "strategy": strategy,
                         "seed": seed, "status": "completed", PRIMARY: v, "skipped_steps": 0,
                         "strategy_overhead_frac": 0.01, "act_zero_frac_mean": 0.1})
        for k in range((diverged or {}).get(strategy, 0)):
            rows.append({"workload": "w", "precision": "fp16", "strategy": strategy,
                         "seed": 100 + k, "status": "diverged", PRIMARY: float("nan"),
                         "skipped_steps": 0, "strategy_overhead_frac": 0.01,
                         "act_zero_frac_mean": 0.1})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 10, 20, 37])
@pytest.mark.parametrize("level", [0.9, 0.95])
def test_clopper_pearson_is_scipys_exact_interval_and_the_beta_quantiles(n, level):
    """One implementation of the exact binomial interval (paired P(better), claims' rates):
    scipy's binomtest(...).proportion_ci(method="exact"), and Clopper & Pearson's closed form
    B(α/2; k, n−k+1), B(1−α/2; k+1, n−k) with 0 and 1 at the ends."""
    alpha = 1 - level
    for k in range(n + 1):
        lo, hi = clopper_pearson(k, n, level)
        ci = sps.binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
        assert (lo, hi) == (ci.low, ci.high)
        beta_lo = 0.0 if k == 0 else sps.beta.ppf(alpha / 2, k, n - k + 1)
        beta_hi = 1.0 if k == n else sps.beta.ppf(1 - alpha / 2, k + 1, n - k)
        assert lo == pytest.approx(beta_lo, abs=1e-9) and hi == pytest.approx(beta_hi, abs=1e-9)
        assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_ranking_follows_true_order_and_ties_overlapping_intervals():
    runs = _runs({
        "a": [1.00, 1.01, 1.02],
        "b": [1.005, 1.015, 1.025],  # overlaps a → tie
        "c": [2.0, 2.01, 2.02],
        "d": [3.0, 3.02, 3.04],
    })
    r = rank_strategies(summarize(runs)).set_index("strategy")
    assert r.loc["a", "rank"] == r.loc["b", "rank"] == 1
    assert (r.loc["c", "rank"], r.loc["d", "rank"]) == (3, 4)
    assert r.loc["a", "tied_with"] == "b" and r.loc["c", "tied_with"] == ""


def test_divergence_ranks_below_any_strategy_that_always_finished():
    runs = _runs({"lucky": [0.5, 0.5], "steady": [1.0, 1.1, 1.2]}, diverged={"lucky": 1})
    r = rank_strategies(summarize(runs)).set_index("strategy")
    assert (r.loc["steady", "rank"], r.loc["lucky", "rank"]) == (1, 2)
    assert r.loc["lucky", "diverged_frac"] == pytest.approx(1 / 3)


def test_comparison_counts_diverged_runs_as_losses_in_rank_statistics():
    runs = _runs({"native": [1.0, 1.1, 1.2], "x": [0.5, 0.6]}, diverged={"x": 2})
    c = compare_to_baseline(runs).set_index("metric").loc[PRIMARY]
    assert (c["n"], c["n_base"]) == (4, 3)
    assert c["poi"] == pytest.approx(0.5)  # 2 runs beat all, 2 diverged lose to all
    assert c["mean"] == pytest.approx(0.55)  # means use finished runs only
    assert c["diff"] == pytest.approx(0.55 - 1.1)


def test_synthetic_sweep_ranks_in_the_true_order(tmp_path):
    """Known truth: max_ema < layerwise < native < none (loss), 10 sd apart."""
    write_sweep(tmp_path / "s", SweepSpec(seeds=4, extras=False))
    rs = load_runs(tmp_path / "s")
    summary = summarize(rs.runs, n_boot=500)
    ranks = rank_strategies(summary)
    fp16 = ranks[ranks["precision"] == "fp16"].sort_values("rank")
    assert fp16["strategy"].tolist() == ["max_ema", "layerwise", "native", "none"]
    assert fp16["rank"].tolist() == [1, 2, 3, 4]
    comps = compare_to_baseline(rs.runs, n_boot=500)
    loss = comps[comps["metric"] == PRIMARY].set_index("strategy")
    assert loss.loc["max_ema", "poi"] == 1.0 and loss.loc["none", "poi"] == 0.0
    assert (loss["welch_p"] < 0.01).all()
    # each summary interval contains its group's sample mean and the true means are ordered
    for _, row in summary.iterrows():
        assert row[f"{PRIMARY}_mean_lo"] <= row[f"{PRIMARY}_mean"] <= row[f"{PRIMARY}_mean_hi"]


def test_summary_counts_every_status(sweep):
    root, _ = sweep
    summary = summarize(load_runs(root).runs, n_boot=200)
    fp16 = summary[summary["precision"] == "fp16"].set_index("strategy")
    assert fp16.loc["max_ema", ["n_completed", "n_failed"]].tolist() == [3, 1]
    assert fp16.loc["none", ["n_completed", "n_diverged"]].tolist() == [3, 1]
    assert fp16.loc["native", ["n_completed", "n_incomplete"]].tolist() == [3, 1]
    assert fp16.loc["max_ema", f"{PRIMARY}_n"] == 3  # the failed run enters no statistic
    total = sum(fp16[c].sum() for c in ("n_completed", "n_diverged", "n_failed",
                                        "n_incomplete"))
    assert total == fp16["n_runs"].sum()


def test_all_pairs_probability_matches_brute_force():
    x, y = [0.3, 0.1, 0.2, 0.2], [0.2, 0.4]
    brute = np.mean([(a < b) + 0.5 * (a == b) for a, b in itertools.product(x, y)])
    assert prob_improvement(x, y) == pytest.approx(brute)


def test_degenerate_samples_give_a_point_or_nan_without_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bootstrap_ci([0.7, 0.7, 0.7]) == (0.7, 0.7)
        assert bootstrap_ci([0.7, 0.7, 0.7, 0.7], "iqm") == (0.7, 0.7)
        assert np.isnan(bootstrap_ci([np.nan, 1.0, np.inf])).all()  # one finite value
        lo, hi = bootstrap_ci([1.0, 2.0])  # two values: BCa or its percentile fallback
        assert 1.0 <= lo <= hi <= 2.0
        assert prob_improvement_ci([1.0, 1.0], [1.0, 1.0]) == (0.5, 0.5)
        assert np.isnan(prob_improvement_ci([1.0], [1.0, 2.0])).all()


def test_bca_is_the_default_and_differs_from_percentile_on_skewed_data():
    x = np.array([0.1, 0.1, 0.2, 0.2, 0.3, 0.4, 2.5, 3.0])
    bca = bootstrap_ci(x)
    pct = bootstrap_ci(x, method="percentile")
    res = sps.bootstrap((x,), np.mean, n_resamples=2000, method="BCa",
                        rng=np.random.default_rng(0))
    assert bca == pytest.approx(tuple(res.confidence_interval))
    assert bca != pytest.approx(pct)


def _pairs_table_poi(x, y, axis=-1):
    """The statistic as it was before issue 20: the mean over the full n_x × n_y table of
    pairs, per resample (memory n_boot · n_x · n_y)."""
    a = np.moveaxis(np.asarray(x, dtype=float), axis, -1)[..., :, None]
    b = np.moveaxis(np.asarray(y, dtype=float), axis, -1)[..., None, :]
    return np.mean((a < b) + 0.5 * (a == b), axis=(-2, -1))


@pytest.mark.parametrize("chunk", [7, 2**18])
def test_chunked_probability_of_improvement_equals_the_table_of_all_pairs(monkeypatch, chunk):
    """Issue 20: counting pairs by sorting, a chunk of resamples at a time, gives bit for bit
    the numbers of the full table of pairs — with ties, ±inf (diverged runs), -0.0 and NaN."""
    monkeypatch.setattr(stats, "CHUNK", chunk)
    rng = np.random.default_rng(3)
    specials = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 0.5, 2.0])
    for trial in range(60):
        nx, ny, rows = (int(v) for v in rng.integers(1, 25, size=3))
        x = rng.choice(specials, (rows, nx)) if trial % 2 else rng.normal(size=(rows, nx)).round(1)
        y = rng.choice(specials, (rows, ny)) if trial % 3 else rng.normal(size=(rows, ny)).round(1)
        assert np.array_equal(stats._poi(x, y), _pairs_table_poi(x, y), equal_nan=True), trial
        assert stats._poi(x[0], y[0]) == _pairs_table_poi(x[0], y[0])


def test_probability_of_improvement_interval_unchanged_by_the_chunking(monkeypatch):
    """Same RNG draws, same interval as scipy's bootstrap of the old statistic (40 vs 35 runs,
    a diverged one on each side)."""
    rng = np.random.default_rng(4)
    x = np.append(rng.normal(0.0, 1.0, 39).round(2), np.inf)
    y = np.append(rng.normal(0.3, 1.0, 34).round(2), np.inf)
    new = prob_improvement_ci(x, y, n_boot=500)
    monkeypatch.setattr(stats, "_poi", _pairs_table_poi)
    assert new == prob_improvement_ci(x, y, n_boot=500)


def test_bootstrap_memory_does_not_grow_with_seeds_squared():
    """1000 seeds per side, 2000 resamples: the table of all pairs was 2000 × 1000 × 1000
    floats (15 GiB); measured in a fresh process, peak resident memory stays under 1 GiB."""
    code = ("import resource, numpy as np\n"
            "from analysis.stats import prob_improvement_ci, bootstrap_ci\n"
            "rng = np.random.default_rng(0)\n"
            "x, y = rng.normal(size=1000), rng.normal(0.1, 1, size=1000)\n"
            "lo, hi = prob_improvement_ci(x, y, n_boot=2000)\n"
            "assert 0.3 < lo < hi < 0.7, (lo, hi)\n"
            "print(bootstrap_ci(x, 'iqm', n_boot=2000))\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak_kib = int(proc.stdout.split()[-1])
    assert peak_kib < 2**20, f"peak RSS {peak_kib / 1024:.0f} MiB"
