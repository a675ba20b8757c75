"""``make warning-eval``'s statistics against scipy: the AUROC is the Mann-Whitney U over the
pairs, the fit is the minimum of the class-weighted, L2-penalised logistic loss (module docstring of
``experiments.warning.evaluate``; every feature's coefficient >= 0), and the threshold lets at most 5% of the healthy runs alarm."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.stats import mannwhitneyu

from experiments.warning.data import Run
import dataclasses
import math

from experiments.warning.data import NEAR, WORKLOADS, overrides
from experiments.warning.evaluate import (L2, _samples, _scores, auroc, evaluate, evaluate_near, fit, missed,
                                          step_features)
from strategies.tracing import FORMATS, Trace


def test_auroc_is_mann_whitney_u() -> None:
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 6, 17).tolist(), rng.integers(0, 4, 23).tolist()  # ties on purpose
    u = mannwhitneyu(pos, neg, alternative="two-sided").statistic
    assert auroc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)), abs=1e-12)
    assert auroc([1.0], [0.0]) == 1.0 and auroc([0.0], [1.0]) == 0.0


def run(seed: int, failing: bool, n: int = 60) -> Run:
    """A traced run: healthy ones skip now and then, failing ones skip ever more often from n / 3."""
    rng = np.random.default_rng(seed)
    t, scale = Trace(["a"], [1], format=FORMATS["fp16"]), 2.0**16
    for step in range(1, n + 1):
        p = 0.05 + (0.9 * max(step - n / 3, 0) / n if failing else 0.0)
        skip = bool(rng.random() < p)
        loss = 2.0 + (0.05 * max(step - n / 3, 0) if failing else 0.0) + 0.1 * rng.random()
        amax = float(rng.lognormal()) * (1.05 ** max(step - n / 3, 0) if failing else 1.0)
        t.add_row(step, [float(skip), loss, np.nan if skip else amax, 1.0, 0.0, 0.0, 0.1, scale, amax])
        scale = scale / 2 if skip else scale
    return Run("w", "native", seed, failing, "diverged" if failing else "completed", t)


def test_the_fit_minimises_the_weighted_penalised_logistic_loss() -> None:
    runs = [run(k, f) for k in range(6) for f in (True, False)]
    feats = {id(r): step_features(r) for r in runs}
    model = fit(runs, feats)
    x, y = _samples(runs, feats)
    z = np.hstack([np.ones((len(x), 1)), (x - model["mean"]) / model["scale"]])
    w = np.where(y == 1, 0.5 / y.sum(), 0.5 / (1 - y).sum()) * len(y)

    def loss(b: np.ndarray) -> float:
        m = z @ b
        return float(np.sum(w * (np.logaddexp(0, m) - y * m)) + 0.5 * L2 * np.sum(b[1:] ** 2))

    bounds = [(None, None)] + [(0, None)] * (z.shape[1] - 1)  # every feature a sign of risk: coefficient >= 0
    best = minimize(loss, np.zeros(z.shape[1]), method="L-BFGS-B", bounds=bounds, options={"gtol": 1e-10, "ftol": 1e-14})
    ours = np.array([model["intercept"], *model["coef"]])
    assert min(model["coef"]) >= 0 and loss(ours) <= best.fun + 1e-6
    np.testing.assert_allclose(ours, best.x, atol=1e-3)
    free = minimize(loss, np.zeros(z.shape[1]), method="BFGS").x
    assert free[1:].min() < 0  # the case holds a feature the unconstrained fit would weigh as safety
    healthy = [max(_scores(r, model)) for r in runs if not r.failed]
    assert sum(s >= model["threshold"] for s in healthy) <= 0.05 * len(healthy)
    assert model["threshold"] == np.nextafter(max(healthy), 1.0)  # 6 healthy runs: none may alarm, the lowest such


def test_missed_lists_the_failing_runs_not_warned_at_a_fifth_of_their_horizon() -> None:
    runs = [run(k, f) for k in range(6) for f in (True, False)]
    flat = Trace(["a"], [1], format=FORMATS["fp16"])  # fails with no sign before it: a flat trace, then diverged
    for step in range(1, 61):
        flat.add_row(step, [0.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.1, 2.0**16, 1.0])
    abrupt = Run("w", "native", 7, True, "diverged", flat)
    feats = {id(r): step_features(r) for r in [*runs, abrupt]}
    model = fit(runs, feats)
    out = missed([*runs, abrupt], model, feats)
    want = []
    for r in [*runs, abrupt]:
        first = next((st for st, s in zip(r.trace.steps, _scores(r, model)) if s >= model["threshold"]), None)
        if r.failed and (first is None or first > 48):  # 0.8 * 60
            want.append((r.seed, first, sum(r.trace.found_inf[:48])))
    assert [(m["seed"], m["alarm"], m["skips_before"]) for m in out] == want and want[-1][0] == 7
    assert all(m["end"] == 60 and m["loss_rise"] is not None for m in out)


def test_false_alarms_are_listed_with_their_first_step_and_words() -> None:
    runs = [run(k, f) for k in range(6) for f in (True, False)]
    feats = {id(r): step_features(r) for r in runs}
    model = dict(fit(runs, feats))
    model["threshold"] = sorted(max(_scores(r, model)) for r in runs if not r.failed)[3]  # 3 healthy runs alarm
    e = evaluate(runs, model)
    want = [(r.seed, next(st for st, s in zip(r.trace.steps, _scores(r, model)) if s >= model["threshold"]))
            for r in runs if not r.failed and max(_scores(r, model)) >= model["threshold"]]
    assert e["false_alarms"] == len(want) == 3
    assert [(f["seed"], f["step"]) for f in e["false_alarm_runs"]] == want
    assert all(f["reason"] and f["end"] == 60 for f in e["false_alarm_runs"])


def test_near_edge_runs_train_at_a_third_of_the_failing_rate_and_the_twins_as_before() -> None:
    """The twins' overrides are those their runs were trained with (runs are reused by them); the
    near-edge run differs only in its learning rate, the failing one over NEAR."""
    for w, (shared, lr) in WORKLOADS.items():
        (rate,) = lr
        base = float(rate.split("=")[1])
        failing, healthy, near = (overrides(w, 5, role) for role in ("failing", "healthy", "near"))
        assert rate in failing and f"optimizer.lr={base / 10:g}" in healthy and f"optimizer.lr={base / NEAR:g}" in near
        assert [o for o in near if not o.startswith("optimizer.lr=")] == [o for o in failing if not o.startswith("optimizer.lr=")]


def test_near_edge_runs_are_scored_against_the_held_out_failures() -> None:
    """Near-edge runs that stay healthy are negatives against the held-out runs that failed (each scored
    up to its failing twin's 0.8 T); those that fail are counted apart, warned in time or not."""
    held = [run(k, f) for k in range(6, 9) for f in (True, False)]
    train = [run(k, f) for k in range(6) for f in (True, False)]
    model = fit(train, {id(r): step_features(r) for r in train})
    near = [dataclasses.replace(run(k + 50, k % 2 == 0), seed=k, failing=False, near=True) for k in range(6, 10)]
    n = evaluate_near(near, held, model)
    healthy = [r for r in near if not r.failed]
    failed_held = {r.seed: r for r in held if r.failed}

    def top(r, cut):
        return max([s for st, s in zip(r.trace.steps, _scores(r, model)) if st <= cut], default=0.0)

    pos = [top(r, math.floor(0.8 * r.end)) for r in failed_held.values()]
    neg = [top(r, math.floor(0.8 * failed_held[r.seed].end) if r.seed in failed_held else r.end) for r in healthy]
    assert n["healthy"] == len(healthy) == 2 and n["failed"] == 2 and n["runs"] == 4
    assert n["auroc"] == auroc(pos, neg)
    assert n["false_alarms"] == sum(max(_scores(r, model)) >= model["threshold"] for r in healthy)
    assert n["failed_detected"] == evaluate([r for r in near if r.failed], model)["detected"]
    assert n["skipped_steps"] == sum(int(sum(r.trace.found_inf)) for r in healthy)
