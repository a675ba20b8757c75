"""Performance profiles across workloads (AlgoPerf) with rliable's aggregates (issue 22, item 6).

A **workload** here is one (workload, precision) cell below fp32 where ``native`` ran; a
**strategy** is profiled when it ran on every such cell. Time is :func:`time_to_target`: the
run's ``steps_to_target`` (:mod:`analysis.targets`) where it reached its target, ``+inf`` where
it did not (a completed run that never got there, or one that diverged or stalled).

The rules of Dahl et al., *Benchmarking Neural Network Training Algorithms* (arXiv 2306.07179,
2023; mlcommons/algorithmic-efficiency ``scoring/performance_profile.py`` and
``scoring/score_submissions.py``), after Dolan & Moré, *Benchmarking optimization software with
performance profiles* (Math. Programming 2002):

* per strategy s and workload w, ``t_{s,w}`` = the **median over seeds** of the time to target
  (AlgoPerf: the median over studies, ``np.median(time_vals_per_study)``; inf when not reached);
* **performance ratio** ``r_{s,w} = t_{s,w} / min_s t_{s,w}``; ``+inf`` where s missed the target,
  and where no strategy reached it (AlgoPerf's ``inf / inf`` is NaN, which no ``τ`` counts);
* **profile** ``ρ_s(τ) = |{w : r_{s,w} ≤ τ}| / W``;
* **score** ``B_s = 1/(τ_max − 1) ∫_1^{τ_max} ρ_s(τ) dτ`` with ``τ_max = 4`` — computed exactly:
  ``ρ`` is a step function, so ``B_s = mean_w clip((τ_max − r_{s,w}) / (τ_max − 1), 0, 1)``.
  AlgoPerf integrates with ``np.trapz`` on 100 points of ``linspace(1, 4)`` (within 0.006 of
  the exact value); its rule "a time over 4× the best is inf" changes nothing in ``[1, 4]``.

With it, after Agarwal et al., *Deep Reinforcement Learning at the Edge of the Statistical
Precipice* (NeurIPS 2021; google-research/rliable ``metrics.py``):

* **normalised score** of a run ``u = t_ref,w / t`` — its speed relative to fp32: ``t_ref,w`` is
  the median time to target of the fp32 reference runs of w (one constant per task, as rliable's
  human-normalised scores); 0 for a run that missed the target; higher is better;
* **IQM** of ``u`` over all (workload, seed) runs of a strategy (:func:`analysis.stats.iqm`);
* **P(improvement)** vs ``native``: ``mean_w P(t_s < t_native)`` with ties counting ½, each term
  over all pairs of runs of w (:func:`analysis.stats.prob_improvement`; rliable's
  ``probability_of_improvement`` averages over tasks the same way).

**Intervals**: 95 % percentile bootstrap, ``n_boot`` resamples from ``np.random.default_rng(seed)``
(deterministic), resampling seeds with replacement **within every workload** (stratified, as
rliable's ``StratifiedBootstrap``), the same seeds for every strategy in a resample (seeds fix
init and data, so the runs of one seed are paired; rliable resamples the two sides of
P(improvement) independently instead). ``B_s − B_native`` is computed on each resample: its
interval is the paired bootstrap of the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.stats import LEVEL, N_BOOT, SEED, iqm, prob_improvement, prob_improvement_rows
from analysis.tables import BASELINE
from analysis.targets import REFERENCE_PRECISION, REFERENCE_STRATEGY, targets, train_loss

__all__ = ["COLUMNS", "Suite", "TAU_MAX", "cross_workload", "ratios", "rho", "score", "suite",
           "time_to_target"]

TAU_MAX = 4.0

COLUMNS = ["strategy", "n_workloads", "n_runs", "b", "b_lo", "b_hi", "b_vs_native",
           "b_vs_native_lo", "b_vs_native_hi", "iqm", "iqm_lo", "iqm_hi", "poi", "poi_lo",
           "poi_hi", "rho_1", "b_vs_top", "b_vs_top_lo", "b_vs_top_hi"]


def time_to_target(runs: pd.DataFrame, train: pd.DataFrame) -> pd.Series:
    """Per run (same index): ``steps_to_target`` where its training loss reached the target,
    ``+inf`` where it did not, NaN where not comparable (no target, no train line)."""
    out = pd.to_numeric(runs.get("steps_to_target", pd.Series(np.nan, index=runs.index)),
                        errors="coerce").astype(float)
    loss = train_loss(train)
    target = targets(runs, loss)
    best = loss.groupby("run_id")["value"].min()
    for i, r in runs.iterrows():
        key = (r["workload"], r["seed"])
        if not np.isfinite(out[i]) or key not in target.index or r["run_id"] not in best.index:
            continue
        if best[r["run_id"]] > target[key]:  # censored: never reached within the run
            out[i] = np.inf
    return out


def ratios(t: np.ndarray) -> np.ndarray:
    """``r = t / min over strategies`` along the last axis; ``+inf`` where ``t`` is inf or no
    strategy reached the target."""
    t = np.asarray(t, dtype=float)
    best = np.min(t, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = t / best
    return np.where(np.isfinite(t) & np.isfinite(best), r, np.inf)


def rho(r: np.ndarray, tau: float) -> np.ndarray:
    """``ρ(τ)``: the fraction of workloads (axis -2) whose ratio is at most ``tau``."""
    return np.mean(np.asarray(r) <= tau, axis=-2)


def score(r: np.ndarray, tau_max: float = TAU_MAX) -> np.ndarray:
    """``B = 1/(τ_max − 1) ∫_1^τ_max ρ(τ) dτ`` per strategy, exactly (workloads on axis -2)."""
    if not tau_max > 1:
        raise ValueError(f"tau_max must be > 1, got {tau_max!r}")
    with np.errstate(invalid="ignore"):
        part = np.clip((tau_max - np.maximum(r, 1.0)) / (tau_max - 1.0), 0.0, 1.0)
    return np.mean(np.where(np.isfinite(r), part, 0.0), axis=-2)


@dataclass
class Suite:
    """Times of the profiled strategies: per workload a (seeds × strategies) array, the fp32
    reference's median time, and what was left out (one line each)."""

    strategies: list[str]
    workloads: list[str]
    times: list[np.ndarray]
    ref_time: np.ndarray
    left_out: list[str]


def suite(runs: pd.DataFrame, t: pd.Series) -> Suite:
    """The profile's workloads and strategies from ``runs`` and their times ``t`` (same index):
    cells below fp32 with ``native``; strategies that ran on all of them; the seeds where every
    one of them has a time (NaN = not comparable leaves the seed out)."""
    df = runs.assign(time=t)
    df = df[df["workload"].notna() & df["precision"].notna() & df["seed"].notna() & df["strategy"].notna()]
    low = df[df["precision"] != REFERENCE_PRECISION]
    cells = sorted({(w, p) for w, p, s in zip(low["workload"], low["precision"], low["strategy"])
                    if s == BASELINE})
    if not cells:
        return Suite([], [], [], np.empty(0), [])
    ran = [set(low.loc[(low["workload"] == w) & (low["precision"] == p), "strategy"])
           for w, p in cells]
    strategies = [BASELINE] + sorted(set.intersection(*ran) - {BASELINE})
    left_out = [f"{s}: not run on every workload" for s in sorted(set.union(*ran)
                                                                   - set(strategies))]
    ref = df[(df["precision"] == REFERENCE_PRECISION) & (df["strategy"] == REFERENCE_STRATEGY)]
    names, times, ref_time = [], [], []
    for w, p in cells:
        cell = low[(low["workload"] == w) & (low["precision"] == p)
                   & low["strategy"].isin(strategies)]
        wide = cell.pivot_table(index="seed", columns="strategy", values="time", aggfunc="mean")
        wide = wide.reindex(columns=strategies).dropna()
        ref_times = ref.loc[ref["workload"] == w, "time"].dropna().to_numpy(dtype=float)
        ref_t = float(np.median(ref_times)) if ref_times.size else np.nan  # no fp32 time: NaN, no warning
        if wide.empty:
            left_out.append(f"{w} @ {p}: no seed with a time for every strategy")
            continue
        names.append(f"{w} @ {p}")
        times.append(wide.to_numpy(dtype=float))
        ref_time.append(ref_t)
    return Suite(strategies, names, times, np.asarray(ref_time, dtype=float), left_out)


def _medians(times: list[np.ndarray]) -> np.ndarray:
    """``t_{s,w}``: the median over seeds (axis -2) per workload, stacked as ``(..., W, S)``."""
    return np.stack([np.median(x, axis=-2) for x in times], axis=-2)


def _scores(times: list[np.ndarray], ref_time: np.ndarray) -> dict[str, np.ndarray]:
    """B, IQM of the normalised score and P(improvement vs native, column 0) per strategy,
    for times with leading batch axes (``(..., seeds, strategies)`` per workload)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.concatenate([np.where(np.isfinite(x), ref_time[k] / x, 0.0)
                            for k, x in enumerate(times)], axis=-2)      # (..., runs, S)
    poi = np.mean(np.stack([_poi_vs_first(x) for x in times], axis=-2), axis=-2)
    return {"b": score(ratios(_medians(times))), "iqm": iqm(u, axis=-2), "poi": poi}


def _poi_vs_first(x: np.ndarray) -> np.ndarray:
    """``P(x_s < x_0) + ½ P(x_s = x_0)`` over all pairs of seeds, per strategy s: ``(..., S)``
    from ``(..., seeds, S)``, counted by sorting in chunks (:func:`analysis.stats.prob_improvement_rows`:
    memory O(chunk), not the O(batch · seeds²) table of all pairs — 19 GiB at 1000 seeds)."""
    return np.stack([prob_improvement_rows(x[..., j], x[..., 0]) for j in range(x.shape[-1])], axis=-1)


def cross_workload(runs: pd.DataFrame, train: pd.DataFrame, *, n_boot: int = N_BOOT,
                   seed: int = SEED, level: float = LEVEL) -> tuple[pd.DataFrame, Suite]:
    """One row per profiled strategy (:data:`COLUMNS`): B, B − B_native, IQM and
    P(improvement vs native), each with its 95 % stratified bootstrap interval, ρ(1), and
    B − B_top against the strategy with the highest B (paired, as B − B_native); and the
    :class:`Suite` behind them."""
    s = suite(runs, time_to_target(runs, train))
    if not s.times:
        return pd.DataFrame(columns=COLUMNS), s
    point = _scores(s.times, s.ref_time)
    point["poi"] = np.array([np.mean([prob_improvement(x[:, j], x[:, 0]) for x in s.times])
                             for j in range(len(s.strategies))])
    rho_1 = rho(ratios(_medians(s.times)), 1.0)
    rng = np.random.default_rng(seed)
    boot = _scores([x[rng.integers(0, len(x), size=(n_boot, len(x)))] for x in s.times],
                   s.ref_time)
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    top = int(np.argmax(point["b"]))  # the highest B (the first of equals)
    n_runs = int(sum(len(x) for x in s.times))
    rows = []
    for j, name in enumerate(s.strategies):
        iv = {k: np.percentile(v[:, j], q) for k, v in boot.items()}
        d = np.percentile(boot["b"][:, j] - boot["b"][:, 0], q)
        d_top = np.percentile(boot["b"][:, j] - boot["b"][:, top], q)
        rows.append([name, len(s.workloads), n_runs, point["b"][j], *iv["b"],
                     point["b"][j] - point["b"][0], *d, point["iqm"][j], *iv["iqm"],
                     point["poi"][j], *iv["poi"], float(rho_1[j]),
                     point["b"][j] - point["b"][top], *d_top])
    return pd.DataFrame(rows, columns=COLUMNS), s
