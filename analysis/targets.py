"""Time to target: how many steps a run needs to reach the loss its fp32 twin had at half time
(issue 12, item 3).

For a run of workload W and seed s, the **target** is the training loss of the fp32 reference
run of W and s (strategy ``none`` at ``fp32``, completed) at its first logged step ≥ half its
steps. The training loss is ``loss_avg`` of the kind-``train`` lines — the mean over the log
window, smoother than the one-step ``loss`` — or ``loss`` where a run logged no ``loss_avg``.
Half its steps is half the reference's ``steps`` (summary), or of its last logged step when the
summary has none. Where a seed has more than one completed reference run, the target is the
mean of theirs.

The run's ``steps_to_target`` is the first logged step at which its own training loss is at or
below the target (finite values only). A **completed** run that never gets there has its last
logged step (its length): a lower bound on its true time, *censored* at the end of the run, so a
paired difference against it understates the gap in both directions (a rule that reaches the
target at step 40 where ``native`` never does within 100 steps reads Δ = -60, not -∞) and the
paired t-test can still call it. A run that stopped early (diverged, stalled) without reaching it
is ``+inf``: its length says nothing about its speed, so it loses its seed in the paired and rank
statistics and is left out of means (:attr:`analysis.tables.Metric.inf_loses`), like a diverged
run on final eval loss. NaN when the
run has no identity, or its workload and seed have no completed fp32 reference with a loss at
half time (not comparable). The reference's own value is at most its half-time step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics import STEPS_TO_TARGET

__all__ = ["COLUMN", "REFERENCE_PRECISION", "REFERENCE_STRATEGY", "steps_to_target", "targets",
           "train_loss"]

#: Column of the ``runs`` table.
COLUMN = STEPS_TO_TARGET.column
REFERENCE_PRECISION, REFERENCE_STRATEGY = "fp32", "none"


def train_loss(train: pd.DataFrame) -> pd.DataFrame:
    """``run_id``, ``step`` and ``value`` (the training loss, finite only) of every train line:
    ``loss_avg`` where present, else ``loss``."""
    if train.empty or "step" not in train:
        return pd.DataFrame(columns=["run_id", "step", "value"])
    value = pd.Series(np.nan, index=train.index, dtype=float)
    for col in ("loss", "loss_avg"):  # loss_avg wins where both are there
        if col in train:
            v = pd.to_numeric(train[col], errors="coerce").astype(float)
            value = v.where(v.notna(), value)
    out = pd.DataFrame({"run_id": train["run_id"],
                        "step": pd.to_numeric(train["step"], errors="coerce"), "value": value})
    return out[np.isfinite(out["value"]) & np.isfinite(out["step"])]


def targets(runs: pd.DataFrame, loss: pd.DataFrame) -> pd.Series:
    """Target loss per (workload, seed) from the completed fp32 reference runs."""
    ref = runs[(runs["precision"] == REFERENCE_PRECISION)
               & (runs["strategy"] == REFERENCE_STRATEGY) & (runs["status"] == "completed")
               & runs["workload"].notna() & runs["seed"].notna()]
    rows = []
    for _, r in ref.iterrows():
        curve = loss[loss["run_id"] == r["run_id"]].sort_values("step")
        if curve.empty:
            continue
        steps = pd.to_numeric(pd.Series([r.get("steps")]), errors="coerce").iloc[0]
        total = steps if np.isfinite(steps) and steps > 0 else curve["step"].max()
        later = curve[curve["step"] >= total / 2]
        if not later.empty:
            rows.append((r["workload"], r["seed"], float(later["value"].iloc[0])))
    if not rows:
        return pd.Series(dtype=float)
    df = pd.DataFrame(rows, columns=["workload", "seed", "target"])
    return df.groupby(["workload", "seed"])["target"].mean()


def steps_to_target(runs: pd.DataFrame, train: pd.DataFrame) -> pd.Series:
    """The ``steps_to_target`` of every run of ``runs`` (same index); see the module docstring."""
    out = pd.Series(np.nan, index=runs.index, dtype=float)
    if runs.empty:
        return out
    loss = train_loss(train)
    target = targets(runs, loss)
    if target.empty:
        return out
    by_run = {run_id: g.sort_values("step") for run_id, g in loss.groupby("run_id")}
    for i, r in runs.iterrows():
        key = (r["workload"], r["seed"])
        if key not in target.index:
            continue
        curve = by_run.get(r["run_id"])
        if curve is None:  # no train line at all: nothing to say, not "never"
            continue
        hit = curve[curve["value"] <= target[key]]
        if not hit.empty:
            out[i] = float(hit["step"].iloc[0])
        else:  # censored at the end of a completed run; a run that stopped early loses
            out[i] = float(curve["step"].max()) if r.get("status") == "completed" else np.inf
    return out
