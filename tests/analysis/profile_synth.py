"""Hand-made runs with known times to target, for the performance-profile tests (a helper
module, not a test module): each run's training loss is 2.0 until its time, then 0.5; the fp32
reference of every workload and seed reaches its target 1.0 at step 20 of 40."""

from __future__ import annotations

import math
from typing import Mapping

import pandas as pd

from analysis.reproduce.claims.base import ClaimRuns
from analysis.runset import RunSet
from analysis.targets import steps_to_target

STEPS = 40
REF_TIME = 20

#: (workload, precision, strategy) -> one time per seed (``math.inf``: never reaches it; a
#: ``"diverged"`` string: stops at step 10 without reaching it).
Times = Mapping[tuple[str, str, str], list]


def frames(times: Times) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``runs`` (with ``steps_to_target``) and ``train`` tables of ``times`` plus the fp32
    reference of every workload and seed."""
    seeds: dict[str, int] = {}
    for (w, _, _), ts in times.items():
        seeds[w] = max(seeds.get(w, 0), len(ts))
    arms = dict(times)
    for w, n in seeds.items():
        arms[(w, "fp32", "none")] = [REF_TIME] * n
    runs, train = [], []
    for (w, p, s), ts in arms.items():
        for seed, t in enumerate(ts):
            run_id = f"{w}/{p}-{s}/seed{seed}"
            status = "diverged" if t == "diverged" else "completed"
            last = 10 if status == "diverged" else STEPS
            hit = math.inf if status == "diverged" else t
            runs.append(dict(run_id=run_id, workload=w, regime=w.rsplit("/", 1)[-1],
                             precision=p, strategy=s, seed=seed, status=status, steps=STEPS))
            for step in range(1, last + 1):
                loss = 1.0 if s == "none" and p == "fp32" and step >= REF_TIME else \
                    (0.5 if step >= hit else 2.0)
                train.append(dict(run_id=run_id, step=step, loss_avg=loss))
    runs_df, train_df = pd.DataFrame(runs), pd.DataFrame(train)
    runs_df["steps_to_target"] = steps_to_target(runs_df, train_df)
    return runs_df, train_df


def claim_runs(times: Times) -> ClaimRuns:
    """:class:`ClaimRuns` of ``times`` (per-step tables other than ``train`` empty)."""
    runs, train = frames(times)
    empty = pd.DataFrame()
    return ClaimRuns(runs=runs, runset=RunSet(runs=runs, train=train, evals=empty,
                                              fidelity=empty, layers=empty,
                                              group_scales=empty, exp_hist=empty))
