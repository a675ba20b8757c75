"""Paired statistics (issue 12, item 2): per-seed differences, the reading rule, Holm, and the
rate of false calls when there is no true effect."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis.load import load_runs
from analysis.metrics import METRICS, PRIMARY
from analysis.paired import holm, min_wilcoxon_p, paired_stats, reading
from analysis.report import build_report
from analysis.tables import compare_to_baseline, compare_to_reference
from analysis.words import (BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE, NEGLIGIBLE, NO_DIFFERENCE,
                            NOT_COMPARABLE)
from tests.analysis.synth import SweepSpec, write_sweep


def _read(x, y, **kw) -> str:
    row = paired_stats(x, y, n_boot=500)
    row["paired_t_p_holm"] = row["paired_t_p"]
    return reading(row)


def _paired_sweep(tmp_path, native, strategy):
    n = len(native)
    spec = SweepSpec(seeds=n, extras=False, fp32_reference=False, steps=10,
                     finals={("native", "fp16"): list(native), ("max_ema", "fp16"): list(strategy)})
    write_sweep(tmp_path / "s", spec)
    return load_runs(tmp_path / "s").runs


def test_a_small_gain_in_every_seed_is_clearly_better_despite_seed_spread(tmp_path):
    """Issue 12: a 0.02 gain in each of 8 seeds while seeds differ by 0.3."""
    rng = np.random.default_rng(0)
    native = 2.5 + rng.normal(0.0, 0.3, 8)
    gain = 0.02 + rng.uniform(-0.005, 0.005, 8)
    runs = _paired_sweep(tmp_path, native, native - gain)
    c = compare_to_baseline(runs, n_boot=500).set_index("metric").loc[PRIMARY]
    assert c["reading"] == CLEARLY_BETTER
    assert c["n_pairs"] == 8 and c["p_better"] == 1.0
    assert c["paired_diff"] == pytest.approx(-gain.mean())
    assert c["wilcoxon_p"] == pytest.approx(2 / 2**8)
    assert c["welch_p"] > 0.5  # unpaired, the seed spread hides the gain entirely


def test_a_certain_but_negligible_difference_names_no_winner(tmp_path):
    """Issue 30 follow-up (docs/findings.md named `static` best on 1 - cosine at -8e-08): a gain
    in every seed whose whole interval lies inside the metric's negligible band reads
    NEGLIGIBLE; the same gain with no band, or a band it leaves, is clearly better."""
    rng = np.random.default_rng(5)
    native = 2.5 + rng.normal(0.0, 0.3, 8)
    tiny = 8e-8 + rng.uniform(-5e-9, 5e-9, 8)
    row = paired_stats(native - tiny, native, n_boot=500)
    row["paired_t_p_holm"] = row["paired_t_p"]
    assert reading(row) == CLEARLY_BETTER
    assert reading(row, negligible=1e-6) == NEGLIGIBLE
    assert reading(row, negligible=8e-8) == CLEARLY_BETTER  # the interval reaches past the band
    same = paired_stats(native, native, n_boot=500)
    assert reading(dict(same, paired_t_p_holm=1.0), negligible=1e-6) == NO_DIFFERENCE
    runs = _paired_sweep(tmp_path, native, native - 5e-5 - rng.uniform(0, 1e-6, 8))
    c = compare_to_baseline(runs, n_boot=500).set_index("metric").loc[PRIMARY]
    assert METRICS[0].negligible == 1e-4 and c["reading"] == NEGLIGIBLE


def test_an_alternating_difference_is_not_called(tmp_path):
    rng = np.random.default_rng(1)
    native = 2.5 + rng.normal(0.0, 0.3, 8)
    sign = np.array([1, -1] * 4)
    runs = _paired_sweep(tmp_path, native, native + 0.02 * sign)
    c = compare_to_baseline(runs, n_boot=500).set_index("metric").loc[PRIMARY]
    assert c["reading"] == NO_DIFFERENCE
    assert c["p_better"] == 0.5 and c["wilcoxon_p"] == 1.0


def test_the_call_is_possible_with_five_seeds_but_needs_every_seed():
    rng = np.random.default_rng(2)
    base = 2.5 + rng.normal(0.0, 0.3, 5)
    steady = base - 0.05 + rng.uniform(-0.01, 0.01, 5)
    assert min_wilcoxon_p(5) == pytest.approx(2 / 32) and min_wilcoxon_p(6) == pytest.approx(2 / 64)
    assert _read(steady, base) == CLEARLY_BETTER
    assert _read(base + 0.05, base) == CLEARLY_WORSE
    one_against = steady.copy()
    one_against[0] = base[0] + 0.01  # four seeds better, one slightly worse: not "clearly"
    assert _read(one_against, base) in (BETTER_FEW, NO_DIFFERENCE)


def test_holm_matches_the_step_down_definition():
    p = [0.01, 0.04, 0.03, float("nan"), 0.005]
    got = holm(p)
    # sorted 0.005, 0.01, 0.03, 0.04 → ×4, ×3, ×2, ×1 then running max
    assert got[4] == pytest.approx(0.02) and got[0] == pytest.approx(0.03)
    assert got[2] == pytest.approx(0.06) and got[1] == pytest.approx(0.06)
    assert np.isnan(got[3])
    assert holm([0.5, 0.9]).tolist() == [1.0, 1.0]  # 0.5 × 2, then monotone


def test_degenerate_pairs_never_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = paired_stats([1.0], [2.0])
        same = paired_stats([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
        const = paired_stats([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
        empty = paired_stats([], [])
    assert one["n_pairs"] == 1 and np.isnan(one["paired_t_p"])
    assert reading(dict(one, paired_t_p_holm=np.nan)) == NOT_COMPARABLE
    assert same["paired_t_p"] == 1.0 and same["wilcoxon_p"] == 1.0 and same["p_better"] == 0.5
    assert reading(dict(same, paired_t_p_holm=1.0)) == NO_DIFFERENCE
    assert (const["paired_diff_lo"], const["paired_diff_hi"]) == (-0.5, -0.5)
    assert const["paired_t_p"] == 0.0
    assert empty["n_pairs"] == 0


def test_paired_stats_match_scipy():
    rng = np.random.default_rng(3)
    y = rng.normal(0, 1, 9)
    x = y + rng.normal(-0.3, 0.2, 9)
    s = paired_stats(x, y, n_boot=300)
    assert s["paired_t_p"] == pytest.approx(sps.ttest_rel(x, y).pvalue)
    assert s["wilcoxon_p"] == pytest.approx(sps.wilcoxon(x - y, method="exact").pvalue)
    k = int(np.sum(x < y))
    ci = sps.binomtest(k, 9).proportion_ci(method="exact")
    assert (s["p_better_lo"], s["p_better_hi"]) == pytest.approx((ci.low, ci.high))


def test_diverged_runs_lose_their_seed():
    x = [np.inf, np.inf, np.inf, np.inf, np.inf, np.inf]
    y = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05]
    s = paired_stats(x, y)
    assert s["n_pairs"] == 6 and s["p_better"] == 0.0 and np.isnan(s["paired_diff"])
    assert s["wilcoxon_p"] == pytest.approx(2 / 64)
    assert reading(dict(s, paired_t_p_holm=np.nan)) == "worse in these seeds, but too few seeds"


def _null_runs(rng: np.random.Generator, n_seeds: int, n_strategies: int = 4) -> pd.DataFrame:
    seed_effect = rng.normal(0.0, 0.3, n_seeds)
    rows = []
    for k, strategy in enumerate(["native", *[f"s{i}" for i in range(n_strategies)]]):
        for seed in range(n_seeds):
            rows.append({"workload": "w", "precision": "fp16", "strategy": strategy,
                         "seed": seed, "status": "completed",
                         PRIMARY: 2.5 + seed_effect[seed] + rng.normal(0.0, 0.02)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("n_seeds", [3, 5, 8])
def test_no_true_effect_is_rarely_called_clearly(n_seeds):
    """Many comparisons with no true effect (shared seed effects, independent noise): the
    fraction read "clearly better/worse" stays at or below 5 %."""
    rng = np.random.default_rng(100 + n_seeds)
    readings = []
    for _ in range(100):
        comps = compare_to_baseline(_null_runs(rng, n_seeds), metrics=METRICS[:1], n_boot=100)
        readings += comps["reading"].tolist()
    clearly = np.mean([r in (CLEARLY_BETTER, CLEARLY_WORSE) for r in readings])
    assert len(readings) == 400
    assert clearly <= 0.05  # measured: 1-2 % at 3, 5, 6 and 8 seeds


def test_report_reads_against_native_and_fp32(tmp_path):
    rng = np.random.default_rng(4)
    ref = 2.4 + rng.normal(0.0, 0.3, 6)
    finals = {("none", "fp32"): list(ref), ("native", "fp16"): list(ref + 0.1),
              ("max_ema", "fp16"): list(ref + 0.1 - 0.03 + rng.uniform(-0.005, 0.005, 6))}
    write_sweep(tmp_path / "s", SweepSpec(seeds=6, extras=False, fp32_reference=False,
                                          steps=10, finals=finals))
    runs = load_runs(tmp_path / "s").runs
    ref_rows = compare_to_reference(runs, n_boot=300).set_index("strategy")
    assert set(ref_rows["baseline"]) == {"fp32"}
    assert ref_rows.loc["native", "reading"] == CLEARLY_WORSE
    assert ref_rows.loc["native", "paired_diff"] == pytest.approx(0.1)
    build_report([tmp_path / "s"], tmp_path / "o", n_boot=300)
    comps = pd.read_csv(tmp_path / "o" / "comparisons.csv")
    row = comps[(comps["strategy"] == "max_ema") & (comps["metric"] == PRIMARY)
                & (comps["baseline"] == "native")].iloc[0]
    assert row["reading"] == CLEARLY_BETTER
    assert {"paired_diff", "paired_t_p_holm", "wilcoxon_p", "p_better_lo", "welch_p",
            "mwu_p", "poi"} <= set(comps.columns)
    md = (tmp_path / "o" / "report.md").read_text(encoding="utf-8")
    assert "`max_ema` vs `native`: clearly better than native (6 paired seeds" in md
    assert "## Each strategy against the fp32 run of the same seed" in md
