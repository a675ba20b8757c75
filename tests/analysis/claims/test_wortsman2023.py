"""Wortsman et al. 2023 (analysis/reproduce/claims/wortsman2023.py): the LR-sensitivity formula against a
plain re-statement, the per-seed helpers and every verdict on hand-made runs, ℓ0 against the
model's real first loss, and (slow) the experiment end to end at toy size."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import ClaimRuns, load_claim_runs
from analysis.reproduce.claims.wortsman2023 import (CLAIM, L0, LR, QK, evaluate, lr_sensitivity, per_seed_metric,
                                          sensitivities)
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from experiments.app import recipe
from experiments.workloads.data import CharData, step_generator
from experiments.workloads.models import GPT

REPO = Path(__file__).resolve().parents[3]
RATES = (0.01, 0.1, 1.0)
SEEDS = range(10)


def plain_sensitivity(losses: list[float], l0: float) -> float:
    """The paper's Sec. 2.2 formula written out: the mean over the sweep of min(loss, l0), minus
    the smallest loss of the sweep."""
    clipped = 0.0
    for x in losses:
        clipped += x if x < l0 else l0
    return clipped / len(losses) - min(losses)


@pytest.mark.parametrize("losses", [[2.7, 3.0, 4.1], [2.7, 3.0, math.inf], [3.2, 6.0, 2.9, 9.5],
                                    [5.0], [7.0, 8.0]])
def test_lr_sensitivity_is_the_papers_formula(losses):
    got = lr_sensitivity(dict(zip(range(len(losses)), losses)), 5.5)
    assert got == pytest.approx(plain_sensitivity(losses, 5.5), abs=1e-12)


def test_lr_sensitivity_counts_nan_as_diverged_and_refuses_an_empty_sweep():
    assert lr_sensitivity({0.1: 2.0, 1.0: math.nan}, 5.0) == pytest.approx((2.0 + 5.0) / 2 - 2.0)
    with pytest.raises(ValueError, match="losses"):
        lr_sensitivity({}, 5.0)


def _run(precision, strategy, qk, lr, seed, loss, status="completed", skipped=0, steps=40, module=None):
    return {"precision": precision, "strategy": strategy, QK: qk, LR: lr, "seed": seed, "status": status,
            "final_eval_loss": loss if status == "completed" else None, "steps": steps,
            "skipped_steps": skipped, "diagnosis_module": module}


def _arm_runs(precision, strategy, qk, losses_of_seed, top_status="completed", top_skipped=0, module=None):
    rows = []
    for seed in SEEDS:
        for lr, loss in zip(RATES, losses_of_seed(seed)):
            top = lr == RATES[-1]
            rows.append(_run(precision, strategy, qk, lr, seed, loss, top_status if top else "completed",
                             top_skipped if top else 0, 10 if top and top_status != "completed" else 40,
                             module if top else None))
    return rows


def _claim_runs(rows) -> ClaimRuns:
    return ClaimRuns(runs=pd.DataFrame(rows), runset=None)


def test_sensitivities_per_seed_clip_diverged_runs_and_need_every_rate():
    rows = _arm_runs("bf16", "none", False, lambda s: [2.7, 3.0 + 0.01 * s, 9.0])
    rows[1]["status"] = "failed"  # seed 0 lacks lr 0.1: left out
    rows[5]["status"] = "diverged"  # seed 1 at lr 1.0: +inf, clipped to l0
    sens = sensitivities(pd.DataFrame(rows), {"precision": "bf16", QK: False}, l0=5.5)
    assert list(sens.index) == list(range(1, 10))
    assert sens[3] == pytest.approx(plain_sensitivity([2.7, 3.03, 9.0], 5.5))
    assert sens[1] == pytest.approx(plain_sensitivity([2.7, 3.01, math.inf], 5.5))
    one_rate = pd.DataFrame([r for r in rows if r[LR] == 1.0])
    assert sensitivities(one_rate, {"precision": "bf16"}).empty


def test_per_seed_metric_shares():
    rows = [_run("fp16", "native", False, 1.0, 0, None, "diverged", skipped=4, steps=10),
            _run("fp16", "native", False, 1.0, 1, 3.0, skipped=2, steps=40),
            _run("fp16", "native", False, 1.0, 2, None, "failed")]
    frame = pd.DataFrame(rows)
    assert per_seed_metric(frame, {}, "skip_share").to_dict() == {0: 0.4, 1: 0.05}
    assert per_seed_metric(frame, {}, "failed").to_dict() == {0: 1.0, 1: 0.0}
    with pytest.raises(ValueError, match="metric"):
        per_seed_metric(frame, {}, "loss")


def _good(seed):  # trains at every rate
    return [2.70 + 0.01 * (seed % 3), 2.95, 3.40 + 0.02 * (seed % 4)]


def _sweep(no_qk_top="diverged", no_qk_skips=4, bf16_no_qk=lambda s: [2.70, 2.95, 3.80 + 0.01 * s]):
    rows = []
    for strategy in ("native", "max_ema"):
        rows += _arm_runs("fp16", strategy, False, _good, no_qk_top, no_qk_skips, "blocks.0.scores")
        rows += _arm_runs("fp16", strategy, True, _good, "completed", 0)
    rows += _arm_runs("bf16", "none", False, bf16_no_qk)
    rows += _arm_runs("bf16", "none", True, _good)
    return _claim_runs(rows)


def test_evaluate_reproduces_when_only_the_model_without_qk_norm_overflows():
    findings = evaluate(_sweep())
    assert len(findings) == 9
    assert [f.verdict for f in findings] == [REPRODUCED] * 9
    sens = findings[0]
    assert "LR sensitivity" in sens.measure and sens.n == 10
    # seed 0: without (2.70 + 2.95 + l0) / 3 - 2.70, with (2.70 + 2.95 + 3.40) / 3 - 2.70
    assert sens.estimate == pytest.approx(sum(
        plain_sensitivity([_good(s)[0], 2.95, math.inf], L0) - plain_sensitivity(_good(s), L0)
        for s in SEEDS) / 10)
    assert findings[2].estimate == 1.0 and findings[3].estimate == 1.0


def test_evaluate_not_reproduced_and_inconclusive():
    # identical arms: differences all zero -> inconclusive; qk-norm worse in bf16 -> not reproduced
    findings = evaluate(_sweep(no_qk_top="completed", no_qk_skips=0, bf16_no_qk=lambda s: [2.70, 2.95, 3.0]))
    by = {f.measure: f for f in findings}
    native = [f for m, f in by.items() if m.startswith("fp16 GradScaler")]
    assert [f.verdict for f in native[:3]] == [INCONCLUSIVE] * 3
    assert native[3].n == 0 and native[3].verdict == INCONCLUSIVE  # no diverged run to locate
    assert findings[-1].verdict == NOT_REPRODUCED


def test_evaluate_on_the_quick_subset_reads_inconclusive_sensitivity():
    frame = _sweep().runs
    quick = _claim_runs(frame[(frame[LR] == 1.0) & frame["strategy"].isin(["native", "none"])])
    findings = evaluate(quick)
    assert len(findings) == 5
    assert findings[0].n == 0 and findings[0].verdict == INCONCLUSIVE
    assert [f.verdict for f in findings[1:4]] == [REPRODUCED] * 3


def test_the_claim_is_registered_with_its_factors():
    assert CLAIM in CLAIMS and CLAIM.name == "wortsman2023"
    assert set(CLAIM.factors) == {LR, QK}
    assert (REPO / "conf" / "experiment" / f"repro_{CLAIM.name}.yaml").is_file()


def test_l0_is_the_real_loss_at_initialisation():
    """ℓ0 = ln 256 against the experiment's model at init, in fp32, on its data (seeds 0-2)."""
    data = CharData(block_size=16, max_bytes=200_000, eval_batch_size=64)
    for seed in range(3):
        torch.manual_seed(seed)
        model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32, attention="explicit")
        x, y = data.batch(16, step_generator(seed, 1))
        with torch.no_grad():
            first = float(recipe.loss(model(x), y))
        assert abs(first - L0) < 0.02


@pytest.mark.slow
def test_the_experiment_end_to_end_at_toy_size(tmp_path: Path):
    sweep = tmp_path / "wortsman2023"
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    for extra in CLAIM.sweeps:
        cmd = [sys.executable, "-m", "experiments.app.train", "-m", f"+experiment=repro_{CLAIM.name}", *extra,
               "seed=0,1", "hydra.sweeper.params.strategy=native",
               "optimizer.lr=0.01,1.0", "train.steps=15", "hydra/launcher=basic",
               f"hydra.sweep.dir={sweep}", "logger=none"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = load_claim_runs(sweep, CLAIM.factors)
    assert len(runs.runs) == 2 * 2 * 2 * 2
    findings = CLAIM.evaluate(runs)
    assert len(findings) == 5
    assert all(f.verdict == INCONCLUSIVE for f in findings)  # 2 seeds < MIN_PAIRS
    assert findings[0].n == 2 and math.isfinite(findings[0].estimate)
