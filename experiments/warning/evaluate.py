"""``make warning-eval``: fit the early warning on held-in runs, evaluate it on held-out ones, write
the coefficients (``strategies/watch/fitted.py``), ``docs/early-warning.md`` and the numbers behind it
(``runs/warning_eval/results.json``).

Horizon and lead: a failing run fails at its last step ``T`` (diverged or stalled); the horizon is
``T`` steps (the time it takes to fail), and a warning counts when it comes at or before
``floor(0.8 T)``: a lead of at least 20% of the horizon. A run's score at ``t`` is the highest
detector score up to ``t``. AUROC: failing runs scored at ``0.8 T`` against healthy runs scored
over the same prefix (their failing twin's ``0.8 T``; the whole run when the twin did not fail).
False alarms: healthy runs whose score reaches the threshold anywhere in the whole run.

Fit: logistic regression (numpy, Newton's method, L2 penalty :data:`L2` on the standardised
features, classes weighted equally, every feature's coefficient >= 0: each feature is a sign of
risk, never of safety) on per-step samples of the twins and the near-edge runs
(:data:`experiments.warning.data.NEAR`) — a failing run's steps in ``(0.4 T, 0.8 T]``
are positives, a healthy run's steps negatives. Threshold: the lowest score at which at most 5% of
the healthy *training* runs alarm. Splits: held-out seeds (fit on the ``TRAIN_SEEDS`` of every
workload, evaluate the other seeds) and held-out workloads (for each workload, fit on the others'
``TRAIN_SEEDS``, evaluate its other seeds): nothing of a held-out run, not its threshold, is fitted on it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.app.records import write_text_atomic
from experiments.warning import page
from experiments.warning.data import SEEDS, TRAIN_SEEDS, WORKLOADS, Run, collect
from strategies.watch.detector import FEATURES, Detector, observations

__all__ = ["L2", "alarm", "auroc", "evaluate", "evaluate_near", "fit", "main", "missed", "step_features"]

L2 = 1.0
FALSE_ALARMS = 0.05
LEAD = 0.2


def step_features(run: Run) -> np.ndarray:
    """Per step, the detector's features (rows from the step the window fills)."""
    det = Detector()
    rows = []
    for o in observations(run.trace):
        det.update(o)
        rows.append([det.features.get(f, math.nan) for f in FEATURES] if det.features else [math.nan] * len(FEATURES))
    return np.array(rows, dtype=float)


def _samples(runs: list[Run], feats: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for r in runs:
        f = feats[id(r)]
        steps = np.array(r.trace.steps)
        keep = ~np.isnan(f).any(axis=1)
        if r.failed:
            keep &= (steps > 0.4 * r.end) & (steps <= 0.8 * r.end)
        xs.append(f[keep])
        ys.append(np.full(int(keep.sum()), 1.0 if r.failed else 0.0))
    return np.concatenate(xs), np.concatenate(ys)


def _newton(z: np.ndarray, y: np.ndarray, w: np.ndarray, penalty: np.ndarray, free: list[int]) -> np.ndarray:
    """The weighted, penalised logistic fit over the columns ``free`` (the others held at 0)."""
    beta = np.zeros(z.shape[1])
    zf, pf = z[:, free], penalty[np.ix_(free, free)]
    b = np.zeros(len(free))
    for _ in range(100):
        p = 1 / (1 + np.exp(-np.clip(zf @ b, -60, 60)))
        step = np.linalg.solve((zf * (w * p * (1 - p))[:, None]).T @ zf + pf, zf.T @ (w * (p - y)) + pf @ b)
        b -= step
        if np.abs(step).max() < 1e-10:
            break
    beta[free] = b
    return beta


def _nonnegative(z: np.ndarray, y: np.ndarray, w: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """The fit with every feature's coefficient >= 0 (active set: a negative one is held at 0, a held
    one whose gradient asks to grow is freed again, until the KKT conditions hold)."""
    free = list(range(z.shape[1]))
    for _ in range(4 * z.shape[1]):
        beta = _newton(z, y, w, penalty, free)
        negative = [j for j in free[1:] if beta[j] < 0]
        if negative:
            free.remove(min(negative, key=lambda j: beta[j]))
            continue
        p = 1 / (1 + np.exp(-np.clip(z @ beta, -60, 60)))
        grad = z.T @ (w * (p - y))
        grow = [j for j in range(1, z.shape[1]) if j not in free and grad[j] < -1e-9]
        if not grow:
            return beta
        free = sorted(free + [min(grow, key=lambda j: grad[j])])
    return beta


def fit(runs: list[Run], feats: dict[int, np.ndarray]) -> dict[str, Any]:
    """The model (module docstring) fitted on ``runs``, its threshold included."""
    x, y = _samples(runs, feats)
    mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-9
    z = np.hstack([np.ones((len(x), 1)), (x - mu) / sd])
    w = np.where(y == 1, 0.5 / max(y.sum(), 1), 0.5 / max((1 - y).sum(), 1)) * len(y)
    beta = _nonnegative(z, y, w, np.diag([0.0] + [L2] * (z.shape[1] - 1)))
    model = {"features": list(FEATURES), "mean": mu.tolist(), "scale": sd.tolist(), "coef": beta[1:].tolist(),
             "intercept": float(beta[0]), "threshold": 0.5}
    healthy = sorted(max(_scores(r, model)) for r in runs if not r.failed)
    allowed = math.floor(FALSE_ALARMS * len(healthy))
    top = healthy[len(healthy) - allowed - 1] if healthy else 0.5
    model["threshold"] = float(min(np.nextafter(top, 1.0), 1.0))
    return model


def _scores(run: Run, model: dict[str, Any]) -> list[float]:
    return Detector(model).run(observations(run.trace))


def alarm(run: Run, model: dict[str, Any]) -> tuple[int, str] | None:
    """The step of the run's first alarm and the warning's words then (None: no alarm)."""
    det = Detector(model)
    for o in observations(run.trace):
        det.update(o)
        if det.alarm_step is not None:
            return det.alarm_step, det.reason()
    return None


def auroc(pos: list[float], neg: list[float]) -> float:
    """P(a positive outscores a negative), ties counting half (Mann-Whitney)."""
    if not pos or not neg:
        return math.nan
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def evaluate(runs: list[Run], model: dict[str, Any]) -> dict[str, Any]:
    """AUROC at a lead of 20% of the horizon, detection, lead and false alarms on ``runs``."""
    twins = {(r.workload, r.strategy, r.seed, r.failing): r for r in runs}
    pos, neg, detected, leads, alarms, healthy, false = [], [], 0, [], 0, 0, []
    for r in runs:
        scores = _scores(r, model)
        steps = r.trace.steps
        if r.failed:
            cut = math.floor((1 - LEAD) * r.end)
            pos.append(max([s for st, s in zip(steps, scores) if st <= cut], default=0.0))
            first = next((st for st, s in zip(steps, scores) if s >= model["threshold"]), None)
            if first is not None and first <= cut:
                detected += 1
            if first is not None:
                leads.append((r.end - first) / r.end)
        else:
            healthy += 1
            twin = twins.get((r.workload, r.strategy, r.seed, not r.failing))
            cut = math.floor((1 - LEAD) * twin.end) if twin is not None and twin.failed else steps[-1]
            neg.append(max([s for st, s in zip(steps, scores) if st <= cut], default=0.0))
            if max(scores) >= model["threshold"]:
                alarms += 1
                step, words = alarm(r, model) or (None, "")
                false.append({"workload": r.workload, "seed": r.seed, "strategy": r.strategy, "step": step,
                              "end": r.end, "reason": words})
    failing = sum(r.failed for r in runs)
    return {"runs": len(runs), "failing": failing, "healthy": healthy, "auroc": auroc(pos, neg),
            "detected": detected, "false_alarms": alarms, "lead_median": float(np.median(leads)) if leads else None,
            "false_alarm_runs": false}


def evaluate_near(near: list[Run], held_out: list[Run], model: dict[str, Any]) -> dict[str, Any]:
    """The model on the near-edge runs (:data:`experiments.warning.data.NEAR`): those that stayed
    healthy as negatives against the held-out runs that failed (AUROC over the same prefix, false
    alarms over the whole run, as :func:`evaluate`), and those that failed, warned in time or not."""
    healthy = [r for r in near if not r.failed]
    failed = [r for r in near if r.failed]
    e = evaluate([r for r in held_out if r.failed] + healthy, model)
    f = evaluate(failed, model) if failed else {"detected": 0}
    return {"runs": len(near), "healthy": len(healthy), "auroc": e["auroc"], "false_alarms": e["false_alarms"],
            "false_alarm_runs": e["false_alarm_runs"], "failed": len(failed), "failed_detected": f["detected"],
            "failed_runs": [{"workload": r.workload, "seed": r.seed, "strategy": r.strategy, "end": r.end,
                             "status": r.status} for r in failed],
            "skipped_steps": sum(int(sum(r.trace.found_inf)) for r in healthy)}


def missed(runs: list[Run], model: dict[str, Any], feats: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    """The failing ``runs`` not warned at a lead >= 20%: where they failed, where the alarm came, and what
    the telemetry showed up to ``0.8 T`` (skipped steps, the highest ``loss_rise``, ``amax_growth`` and
    ``act_fill``, and the run's own activation headroom: ``log2(act_max / act_absmax)``, its lowest)."""
    out = []
    for r in runs:
        if not r.failed:
            continue
        cut = math.floor((1 - LEAD) * r.end)
        scores = _scores(r, model)
        first = next((st for st, s in zip(r.trace.steps, scores) if s >= model["threshold"]), None)
        if first is not None and first <= cut:
            continue
        before = [i for i, st in enumerate(r.trace.steps) if st <= cut]
        f = feats[id(r)][before]
        peak = {name: float(np.nanmax(f[:, FEATURES.index(name)])) if len(f) and not np.isnan(f[:, FEATURES.index(name)]).all()
                else None for name in ("loss_rise", "amax_growth", "act_fill")}
        act = [r.trace.act_absmax[i] for i in before if r.trace.act_absmax[i] > 0]
        headroom = math.log2(r.trace.act_max / max(act)) if act and math.isfinite(r.trace.act_max) else None
        out.append({"workload": r.workload, "seed": r.seed, "strategy": r.strategy, "failing": r.failing, "end": r.end,
                    "status": r.status, "alarm": first, "skips_before": sum(r.trace.found_inf[i] for i in before),
                    "headroom_min": headroom, **peak})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.warning.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/warning_eval"))
    p.add_argument("--page", type=Path, default=Path("docs/early-warning.md"))
    p.add_argument("--fitted", type=Path, default=Path("strategies/watch/fitted.py"))
    args = p.parse_args(argv)
    t0, cpu0 = time.perf_counter(), time.process_time()
    runs = collect(args.out, list(WORKLOADS), SEEDS)
    near = collect(args.out, list(WORKLOADS), SEEDS, near=True)
    feats = {id(r): step_features(r) for r in runs + near}
    train = [r for r in runs if r.seed in TRAIN_SEEDS]
    test = [r for r in runs if r.seed not in TRAIN_SEEDS]
    near_train = [r for r in near if r.seed in TRAIN_SEEDS]  # fitted on with the twins: the harder negatives
    model = fit(train + near_train, feats)
    results = {"model": model, "seeds": evaluate(test, model), "train": evaluate(train, model), "workloads": {},
               "runs": [{"workload": r.workload, "strategy": r.strategy, "seed": r.seed, "failing": r.failing,
                         "near": r.near, "status": r.status, "end": r.end} for r in runs + near]}
    for w in WORKLOADS:
        held = fit([r for r in train + near_train if r.workload != w], feats)
        results["workloads"][w] = {**evaluate([r for r in test if r.workload == w], held), "threshold": held["threshold"]}
    results["near"] = evaluate_near([r for r in near if r.seed not in TRAIN_SEEDS], test, model)
    results["minutes"] = (time.perf_counter() - t0) / 60
    results["cpu_minutes"] = (time.process_time() - cpu0) / 60
    results["missed"] = missed(test, model, feats)
    results["missed_train"] = missed(train, model, feats)
    results["trained"] = sum(r.trained for r in runs + near)
    known = [r.cpu_s for r in runs + near if r.cpu_s is not None]
    results["data_cpu_minutes"] = sum(known) / 60 if known else None
    results["data_cpu_known"] = len(known)
    write_text_atomic(args.out / "results.json", json.dumps(results, indent=1))
    write_text_atomic(args.fitted, page.fitted_module(model))
    write_text_atomic(args.page, page.page(results))
    s = results["seeds"]
    n = results["near"]
    print(f"warning-eval: held-out seeds AUROC {s['auroc']:.3f}, detected {s['detected']}/{s['failing']}, "
          f"false alarms {s['false_alarms']}/{s['healthy']}; near-edge healthy runs: AUROC {n['auroc']:.3f}, "
          f"false alarms {n['false_alarms']}/{n['healthy']}; {args.page} and {args.fitted} written "
          f"({results['minutes']:.1f} min)")




if __name__ == "__main__":
    main()
