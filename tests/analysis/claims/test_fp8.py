"""analysis/reproduce/claims/fp8.py: each verdict on hand-made runs, and the experiment end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import ClaimRuns, load_claim_runs
from analysis.reproduce.claims.fp8 import CLAIM, MARGIN, ROLE_COLUMNS, evaluate
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED

REPO = Path(__file__).resolve().parents[3]
#: (precision, activation, weight, gradient) of each arm of conf/experiment/repro_fp8.yaml
ARMS = [("bf16", None, None, None), ("fp8_hybrid", "current", "current", "current"),
        ("fp8_hybrid", "none", "none", "none"), ("fp8_hybrid", "delayed", "current", "current"),
        ("fp8_hybrid", "current", "delayed", "current"), ("fp8_hybrid", "current", "current", "delayed")]


def _runs(loss, seeds: int = 10, status=lambda arm, seed: "completed") -> ClaimRuns:
    """One row per (arm, seed) with final eval loss ``loss(arm, seed)`` plus a little noise."""
    rng = np.random.default_rng(0)
    rows = []
    for arm in ARMS:
        for seed in range(seeds):
            row = {"precision": arm[0], "seed": seed, "status": status(arm, seed), "strategy": "native",
                   "skipped_steps": 2 if arm[3] == "delayed" else 0,
                   "final_eval_loss": loss(arm, seed) + 0.001 * rng.standard_normal()}
            row.update({ROLE_COLUMNS[r]: v for r, v in zip(("activation", "weight", "gradient"), arm[1:])})
            rows.append(row)
    return ClaimRuns(runs=pd.DataFrame(rows), runset=None)  # type: ignore[arg-type]


def _base(arm, seed) -> float:
    return 3.4 + 0.05 * np.sin(seed)


def test_parity_and_every_penalty_reproduce_when_the_runs_show_them():
    penalty = {ARMS[2]: 0.2, ARMS[3]: 0.01, ARMS[4]: 0.02, ARMS[5]: 0.05}
    findings = evaluate(_runs(lambda arm, seed: _base(arm, seed) + penalty.get(arm, 0.0)))
    assert [f.verdict for f in findings] == [REPRODUCED] * 5
    assert [round(f.estimate, 2) for f in findings] == [0.0, 0.01, 0.02, 0.05, 0.2]
    assert "activation" in findings[1].measure and "gradient" in findings[3].measure
    assert findings[3].note == "2.0 skipped steps per run (all-current: 0.0 skipped steps per run)"
    assert f"±{MARGIN:g}" in findings[0].note and all(f.paper and f.n == 10 for f in findings)


def test_the_opposite_is_not_reproduced():
    # fp8 five margins worse than bf16; delayed and no scaling *better* than current
    change = {ARMS[1]: 5 * MARGIN, ARMS[2]: 4 * MARGIN, ARMS[3]: 4 * MARGIN, ARMS[4]: 4 * MARGIN, ARMS[5]: 4 * MARGIN}
    findings = evaluate(_runs(lambda arm, seed: _base(arm, seed) + change.get(arm, 0.0)))
    assert [f.verdict for f in findings] == [NOT_REPRODUCED] * 5


def test_noise_or_few_seeds_is_inconclusive():
    noisy = lambda arm, seed: _base(arm, seed) + (0.0 if arm == ARMS[1] else 0.2 * (-1) ** seed)  # mean 0, wide
    assert [f.verdict for f in evaluate(_runs(noisy))] == [INCONCLUSIVE] * 5
    assert [f.verdict for f in evaluate(_runs(_base, seeds=5))] == [INCONCLUSIVE] * 5


def test_a_diverged_fp8_arm_breaks_parity():
    status = lambda arm, seed: "diverged" if arm == ARMS[1] else "completed"
    assert evaluate(_runs(_base, status=status))[0].verdict == NOT_REPRODUCED


def test_claim_is_registered_with_its_sources_and_deviations():
    assert CLAIM in CLAIMS and CLAIM.name == "fp8"
    assert "2209.05433" in CLAIM.source and "transformer_engine/common/recipe/__init__.py" in CLAIM.source
    assert len(CLAIM.deviations) >= 5 and set(CLAIM.factors) == set(ROLE_COLUMNS.values())
    assert (REPO / "conf" / "experiment" / f"repro_{CLAIM.name}.yaml").is_file()


@pytest.mark.slow
def test_the_experiment_end_to_end_at_toy_size(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    for extra in CLAIM.sweeps:
        proc = subprocess.run([sys.executable, "-m", "experiments.app.train", "-m", "+experiment=repro_fp8", *extra,
                               f"hydra.sweep.dir={tmp_path}", "logger=none", "train.steps=4", "train.log_every=2",
                               "seed=0,1"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = load_claim_runs(tmp_path, CLAIM.factors)
    assert len(runs.runs) == 12 and set(runs.runs["status"]) == {"completed"}
    fp8 = runs.runs[runs.runs["precision"] == "fp8_hybrid"]
    assert set(fp8[ROLE_COLUMNS["gradient"]]) == {"current", "none", "delayed"}
    findings = CLAIM.evaluate(runs)
    assert len(findings) == 5 and all(f.n == 2 and f.verdict == INCONCLUSIVE for f in findings)
