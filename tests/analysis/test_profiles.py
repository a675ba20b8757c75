"""Issue 22 item 6: performance profiles (AlgoPerf) and rliable's aggregates, each checked
against a plain re-statement of the source's rule on hand-made numbers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.profiles import cross_workload, ratios, rho, score, suite, time_to_target
from analysis.report import build_report
from analysis.when import (BETTER_ACROSS, TIE_ACROSS, WORSE_ACROSS, cross_verdict,
                           cross_workload_table)
from tests.analysis.profile_synth import REF_TIME, frames

INF = math.inf
N_BOOT = 300

#: Two workloads, three strategies, four seeds; a miss, a censored miss and a divergence.
TIMES = {
    ("gpt/c/plain", "fp16", "native"): [20, 30, INF, 20],
    ("gpt/c/plain", "fp16", "max_ema"): [20, 20, 26, "diverged"],
    ("gpt/c/plain", "fp16", "static"): [24, 22, 22, 24],
    ("gpt/c/tiny", "fp16", "native"): [INF, INF, INF, 36],
    ("gpt/c/tiny", "fp16", "max_ema"): [22, 24, 22, 28],
    ("gpt/c/tiny", "fp16", "static"): [INF, INF, INF, INF],
}


def algoperf_scores(times: dict[str, dict[str, float]], tau_max: float = 4.0,
                    num_points: int = 100) -> dict[str, float]:
    """mlcommons/algorithmic-efficiency scoring/performance_profile.py
    (compute_performance_profiles, linear scale) + score_submissions.compute_leaderboard_score
    (normalize=True), re-stated: ``times[submission][workload]`` is the time to target
    (already the median over studies; inf when not reached)."""
    df = pd.DataFrame(times).T  # one row per submission, one column per workload
    best_scores = df.min(axis=0)
    df[df.apply(lambda x: x > 4 * best_scores, axis=1)] = np.inf
    df = df.div(df.min(axis=0), axis=1)
    points = np.linspace(1.0, tau_max, num=num_points)
    # rho(r, tau) = (r <= tau).sum(axis=1) / NUM_BASE_WORKLOADS for every tau, as one array
    perf = (df.to_numpy()[:, :, None] <= points).sum(axis=1) / df.shape[1]
    scores = np.trapezoid(perf, x=points) / (points.max() - points.min())  # numpy 2's np.trapz
    return dict(zip(df.index, scores))


def rliable_iqm(scores: list[float]) -> float:
    """rliable metrics.aggregate_iqm: scipy trim_mean(scores, 0.25) — drop the lowest and the
    highest quarter (floor(n/4) each), mean of the rest."""
    s = sorted(scores)
    k = int(0.25 * len(s))
    middle = s[k:len(s) - k]
    return sum(middle) / len(middle)


def rliable_poi(x_tasks: list[list[float]], y_tasks: list[list[float]]) -> float:
    """rliable metrics.probability_of_improvement: per task P(X > Y) + ½ P(X = Y) over all
    pairs of runs (higher is better), averaged over tasks."""
    per_task = []
    for xs, ys in zip(x_tasks, y_tasks):
        wins = sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
        per_task.append(wins / (len(xs) * len(ys)))
    return sum(per_task) / len(per_task)


def _median_times() -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (w, _, s), ts in TIMES.items():
        out.setdefault(s, {})[w] = float(np.median([INF if t == "diverged" else t for t in ts]))
    return out


def test_time_to_target_is_inf_where_the_target_was_missed_or_the_run_diverged():
    runs, train = frames(TIMES)
    t = time_to_target(runs, train).set_axis(runs["run_id"])
    assert runs.set_index("run_id").loc["gpt/c/plain/fp16-native/seed2", "steps_to_target"] == 40
    assert t["gpt/c/plain/fp16-native/seed2"] == INF  # censored at 40 by targets.py: a miss
    assert t["gpt/c/plain/fp16-max_ema/seed3"] == INF  # diverged
    assert t["gpt/c/plain/fp16-max_ema/seed2"] == 26 and t["gpt/c/tiny/fp32-none/seed0"] == 20


def test_score_matches_algoperfs_profile_and_leaderboard_code():
    med = _median_times()
    names = sorted(med)
    workloads = sorted(med[names[0]])
    r = ratios(np.array([[med[s][w] for s in names] for w in workloads]))
    ours = score(r)
    theirs = algoperf_scores(med)  # 100 points, as AlgoPerf scores
    fine = algoperf_scores(med, num_points=3001)
    for j, s in enumerate(names):
        assert ours[j] == pytest.approx(theirs[s], abs=0.006)
        assert ours[j] == pytest.approx(fine[s], abs=5e-4)
    # by hand: plain medians native 25, max_ema 23, static 23; tiny: native inf, max_ema 23
    assert dict(zip(names, ours)) == pytest.approx(
        {"max_ema": 1.0, "static": 0.5, "native": 0.5 * (4 - 25 / 23) / 3})
    assert dict(zip(names, rho(r, 1.0))) == {"max_ema": 1.0, "native": 0.0, "static": 0.5}


def test_a_workload_no_strategy_solves_counts_for_none():
    r = ratios(np.array([[INF, INF], [10.0, 20.0]]))
    assert np.all(np.isinf(r[0])) and list(score(r)) == [0.5, pytest.approx(0.5 * 2 / 3)]
    with pytest.raises(ValueError, match="tau_max must be > 1"):
        score(r, tau_max=1.0)


def test_cross_workload_point_estimates_match_rliable():
    runs, train = frames(TIMES)
    df, s = cross_workload(runs, train, n_boot=N_BOOT)
    df = df.set_index("strategy")
    assert s.strategies == ["native", "max_ema", "static"] and list(s.ref_time) == [20, 20]
    med = _median_times()
    algo = algoperf_scores(med, num_points=3001)
    for name in s.strategies:
        runs_t = [[INF if t == "diverged" else t for t in TIMES[(w, "fp16", name)]]
                  for w in ("gpt/c/plain", "gpt/c/tiny")]
        native_t = [[INF if t == "diverged" else t for t in TIMES[(w, "fp16", "native")]]
                    for w in ("gpt/c/plain", "gpt/c/tiny")]
        normalised = [REF_TIME / t for ts in runs_t for t in ts]  # 20 / inf = 0: a miss
        assert df.loc[name, "iqm"] == pytest.approx(rliable_iqm(normalised))
        neg = lambda tasks: [[-t for t in ts] for ts in tasks]  # noqa: E731 (faster = higher)
        assert df.loc[name, "poi"] == pytest.approx(rliable_poi(neg(runs_t), neg(native_t)))
        assert df.loc[name, "b"] == pytest.approx(algo[name], abs=5e-4)
        assert df.loc[name, "b_vs_native"] == pytest.approx(algo[name] - algo["native"], abs=5e-4)
        assert df.loc[name, "b_lo"] <= df.loc[name, "b"] + 1e-12 or name == "native"
    native_d = df.loc["native", ["b_vs_native", "b_vs_native_lo", "b_vs_native_hi"]]
    assert native_d.tolist() == [0, 0, 0]
    assert df.loc["native", "poi"] == 0.5 and (df["n_workloads"] == 2).all()
    top = df["b"].idxmax()
    assert top == "max_ema" and df.loc[top, "b_vs_top"] == 0
    assert df.loc["static", "b_vs_top"] == pytest.approx(algo["static"] - algo["max_ema"], abs=5e-4)


def test_bootstrap_resamples_seeds_within_every_workload_paired_and_is_deterministic():
    runs, train = frames(TIMES)
    df, s = cross_workload(runs, train, n_boot=50, seed=7)
    again, _ = cross_workload(runs, train, n_boot=50, seed=7)
    pd.testing.assert_frame_equal(df, again)
    # the rule in plain Python: per resample, per workload draw 4 seed indices with replacement
    # (in workload order, one draw of shape (n_boot, seeds) each), the same for every strategy
    rng = np.random.default_rng(7)
    idx = [rng.integers(0, len(x), size=(50, len(x))) for x in s.times]
    b, diff = [], []
    for k in range(50):
        med = {name: {w: float(np.median(s.times[i][idx[i][k], j]))
                      for i, w in enumerate(s.workloads)}
               for j, name in enumerate(s.strategies)}
        sc = algoperf_scores(med, num_points=3001)
        b.append(sc["max_ema"])
        diff.append(sc["max_ema"] - sc["native"])
    row = df.set_index("strategy").loc["max_ema"]
    assert [row["b_lo"], row["b_hi"]] == pytest.approx(np.percentile(b, [2.5, 97.5]), abs=5e-4)
    assert [row["b_vs_native_lo"], row["b_vs_native_hi"]] == pytest.approx(
        np.percentile(diff, [2.5, 97.5]), abs=1e-3)


def test_a_rule_faster_in_every_seed_of_every_workload_is_separated_from_native():
    times = {(w, "fp16", s): [20 + (s == "native") * 10 + k % 2 for k in range(10)]
             for w in ("m/d/a", "m/d/b", "m/d/c") for s in ("native", "max_ema")}
    df, _ = cross_workload(*frames(times), n_boot=N_BOOT)
    row = df.set_index("strategy").loc["max_ema"]
    assert row["b_vs_native_lo"] > 0 and row["poi_lo"] > 0.5 and row["iqm_lo"] > 0


def test_only_strategies_run_on_every_workload_are_profiled():
    times = dict(TIMES)
    times[("gpt/c/plain", "fp16", "hybrid")] = [20, 20, 20, 20]
    runs, train = frames(times)
    s = suite(runs, time_to_target(runs, train))
    assert "hybrid" not in s.strategies and s.left_out == ["hybrid: not run on every workload"]
    empty, s = cross_workload(runs[runs["strategy"] != "native"], train, n_boot=10)
    assert empty.empty and s.workloads == []


def _table(times: dict) -> pd.DataFrame:
    runs, train = frames(times)
    return cross_workload_table(runs, train, n_boot=N_BOOT)[0].set_index("strategy")


def test_the_when_tables_cross_workload_winner_needs_an_interval_that_excludes_a_tie():
    seeds = range(10)
    one = {(w, "fp16", s): [INF if (w == "m/d/tiny" and s == "native") else 20 + k % 3
                            for k in seeds]
           for w in ("m/d/plain", "m/d/tiny", "m/d/spikes") for s in ("native", "a", "b")}
    one.update({("m/d/tiny", "fp16", "b"): [INF] * 10})  # b ties native: misses tiny too
    df = _table(one)
    assert df.loc["a", "reading"] == BETTER_ACROSS and df.loc["b", "reading"] == TIE_ACROSS
    assert df["winner"].tolist() == [False, True, False]  # native, a, b
    worse = {k: v if k[2] == "native" else [t + 30 for t in v] for k, v in one.items()
             if k[0] != "m/d/tiny"}
    df = _table(worse)
    assert (df.loc[["a", "b"], "reading"] == WORSE_ACROSS).all() and df.loc["native", "winner"]
    two = {k: ([INF] * 10 if k == ("m/d/tiny", "fp16", "native") else [20 + j % 3 for j in seeds])
           for k in one}  # a and b both solve tiny: both ahead of native, not apart
    df = _table(two)
    assert (df.loc[["a", "b"], "reading"] == BETTER_ACROSS).all() and not df["winner"].any()
    assert "no single winner — `a`, `b` have a higher B" in cross_verdict(df.reset_index())
    tie = {k: [20 + k2 % 3 for k2 in seeds] for k in one}
    assert not _table(tie)["winner"].any()
    assert "no winner" in cross_verdict(_table(tie).reset_index())


def test_the_report_writes_the_cross_workload_table_beside_the_per_workload_one(sweep, tmp_path):
    root, _ = sweep
    build_report([root], tmp_path / "o", n_boot=100)
    cross = pd.read_csv(tmp_path / "o" / "cross_workload.csv", keep_default_na=False)
    assert "native" in set(cross["strategy"]) and {"b", "b_vs_native_lo", "iqm", "poi_hi",
                                                   "reading", "winner"} <= set(cross.columns)
    md = (tmp_path / "o" / "report.md").read_text(encoding="utf-8")
    verdict = md.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert verdict.index("| regime | precision | best strategy |") < verdict.index(
        "| strategy | B [95% CI] |") < verdict.index("Across workloads:")
