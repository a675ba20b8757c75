"""Claim ``micikevicius2018`` (analysis/reproduce/claims/micikevicius2018.py): its verdicts on hand-made
runs, the band shares against a plain re-count, the deep CNN's ``pool_every`` against a plain-torch
model, and (slow) the experiment end to end at toy size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import ClaimRuns, load_claim_runs
from analysis.reproduce.claims.micikevicius2018 import CLAIM, band, band_shares, evaluate, parity_margin
from analysis.runset import RunSet
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from experiments.workloads.models import CNN

REPO = Path(__file__).resolve().parents[3]
SEEDS = range(10)


def _hist(rid: str, exps: dict[int, float], zeros: float = 0.0) -> list[dict]:
    return [dict(run_id=rid, step=10, exponent=e, count=c, zeros=zeros) for e, c in exps.items()]


def _runs(fp32_hist: dict[int, float], losses: dict[tuple, list[float]]) -> ClaimRuns:
    """One fp32 run per seed with histogram ``fp32_hist`` (jittered per seed) and, per arm key
    (precision, strategy, loss_scale), final eval losses by seed."""
    rows, hist = [], []
    for (prec, strat, scale), vals in losses.items():
        for seed, loss in zip(SEEDS, vals):
            rid = f"gpt/{prec}-{strat}-S{scale}/seed{seed}"
            rows.append(dict(run_id=rid, model="gpt", precision=prec, strategy=strat, loss_scale=scale,
                             seed=seed, status="completed", final_eval_loss=loss, skipped_steps=0))
            if prec == "fp32":
                hist += _hist(rid, {e: c * (1 + 0.01 * seed) for e, c in fp32_hist.items()})
    empty = pd.DataFrame()
    runset = RunSet(runs=pd.DataFrame(rows), train=empty, evals=empty, fidelity=empty, layers=empty,
                    group_scales=empty, exp_hist=pd.DataFrame(hist))
    return ClaimRuns(runs=runset.runs, runset=runset)


def _by_measure(findings) -> dict[str, object]:
    return {f.measure: f for f in findings}


def _losses(fp32: np.ndarray, s1: np.ndarray, s8: np.ndarray) -> dict[tuple, list[float]]:
    return {("fp32", "none", 1): list(fp32), ("fp16", "static", 1): list(s1), ("fp16", "static", 8): list(s8),
            ("fp16", "native", 65536): list(s8), ("fp16", "static", 65536): list(s8 + 1.0)}


def test_the_paper_regime_reproduces_every_verdict():
    rng = np.random.default_rng(0)
    fp32 = 2.0 + rng.normal(0, 0.1, 10)
    # Fig. 3-like: most nonzero values below 2^-24, some in [2^-27, 2^-24), a few fp16-normal
    hist = {-33: 60.0, -28: 10.0, -26: 15.0, -20: 10.0, -10: 5.0}
    f = _by_measure(evaluate(_runs(hist, _losses(fp32, fp32 + 0.5, fp32 + rng.normal(0, 0.001, 10)))))
    assert f["gpt: share of nonzero fp32 activation gradients below 2^-24"].verdict == REPRODUCED
    assert f["gpt: share of nonzero fp32 activation gradients below 2^-24"].estimate == pytest.approx(0.85)
    assert f["gpt: share of nonzero fp32 activation gradients above 65504"].verdict == REPRODUCED
    assert f["gpt: final eval loss, fp16 S=1 minus fp32"].verdict == REPRODUCED
    assert f["gpt: final eval loss, fp16 S=8 minus fp32"].verdict == REPRODUCED
    assert f["gpt: final eval loss, fp16 dynamic (native) minus fp32"].verdict == REPRODUCED
    assert f["gpt: final eval loss, fp16 S=2^16 minus fp32"].verdict == NOT_REPRODUCED


def test_a_small_model_without_underflow_does_not_reproduce():
    rng = np.random.default_rng(1)
    fp32 = 2.0 + rng.normal(0, 0.1, 10)
    hist = {-30: 0.1, -20: 70.0, -10: 29.9}  # almost nothing below fp16's range
    same = fp32 + rng.normal(0, 0.001, 10)
    f = _by_measure(evaluate(_runs(hist, _losses(fp32, same, same))))
    assert f["gpt: share of nonzero fp32 activation gradients below 2^-24"].verdict == NOT_REPRODUCED
    s1 = f["gpt: final eval loss, fp16 S=1 minus fp32"]
    assert s1.verdict == INCONCLUSIVE and "below 2^-24" in s1.note and "inside the parity margin" in s1.note
    assert f["gpt: final eval loss, fp16 S=8 minus fp32"].verdict == REPRODUCED


def test_band_shares_recount_the_histogram_by_hand():
    exp_hist = pd.DataFrame(_hist("r", {-40: 1.0, -27: 2.0, -25: 3.0, -24: 4.0, -15: 5.0, -14: 6.0,
                                        15: 7.0, 16: 8.0}, zeros=64.0))
    row = band_shares(exp_hist, ["r", "absent"]).set_index("run_id").loc["r"]
    total = 36.0
    assert row["below 2^-27"] == pytest.approx(1 / total)
    assert row["[2^-27, 2^-24)"] == pytest.approx(5 / total)
    assert row["[2^-24, 2^-14) fp16 subnormal"] == pytest.approx(9 / total)
    assert row["[2^-14, 65504] fp16 normal"] == pytest.approx(13 / total)
    assert row["above 65504"] == pytest.approx(8 / total)
    assert row["below 2^-24"] == pytest.approx(6 / total)
    assert row["zero_frac"] == pytest.approx(64 / 100)


def test_band_verdicts_and_few_seeds():
    high = np.linspace(0.7, 0.8, 10)
    assert band("m", "p", high, "above", 0.5).verdict == REPRODUCED
    assert band("m", "p", high, "below", 0.5).verdict == NOT_REPRODUCED
    assert band("m", "p", np.linspace(0.3, 0.7, 10), "above", 0.5).verdict == INCONCLUSIVE
    assert band("m", "p", high[:3], "above", 0.5).verdict == INCONCLUSIVE
    with pytest.raises(ValueError, match="claimed"):
        band("m", "p", high, "more", 0.5)
    assert parity_margin(np.array([1.0, 1.2, 1.4])) == pytest.approx(0.1)
    assert parity_margin(np.array([1.0, 1.0])) == pytest.approx(1e-3)


def test_registered():
    assert CLAIM in CLAIMS and CLAIM.factors == ("loss_scale",) and len(CLAIM.sweeps) == 6


def test_cnn_pool_every_matches_a_plain_torch_vgg_stage_net():
    torch.manual_seed(0)
    net = CNN(in_channels=1, num_classes=3, width=2, depth=4, pool_every=2)
    ref = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    convs = [m for m in net.convs.modules() if isinstance(m, nn.Conv2d)]
    for mine, theirs in zip(convs, [m for m in ref if isinstance(m, nn.Conv2d)]):
        theirs.load_state_dict(mine.state_dict())
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(net(x), net.head(ref(x).mean(dim=(2, 3))))
    # default: one pool per block, the state dict of the original CNN
    assert list(CNN(depth=2).state_dict()) == ["convs.0.0.weight", "convs.0.0.bias", "convs.1.0.weight",
                                               "convs.1.0.bias", "head.weight", "head.bias"]
    with pytest.raises(ValueError, match="model.pool_every"):
        CNN(pool_every=0)


@pytest.mark.slow
def test_the_experiment_end_to_end_at_toy_size(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    for extra in CLAIM.sweeps[:2]:  # the deep CNN's static arms and its fp32 reference
        proc = subprocess.run([sys.executable, "-m", "experiments.app.train", "-m", "+experiment=repro_micikevicius2018",
                               *extra, "seed=0,1", "train.steps=4", "train.hist_every=2", "train.log_every=2",
                               "hydra/launcher=basic", f"hydra.sweep.dir={tmp_path}", "logger=none"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = load_claim_runs(tmp_path, CLAIM.factors)
    assert len(runs.runs) == 8 and set(runs.runs["loss_scale"]) == {1, 8, 65536}
    assert runs.runset.exp_hist["run_id"].str.contains("fp32").any()  # fp32 runs record the histogram
    f = _by_measure(CLAIM.evaluate(runs))
    below = f["cnn_deep: share of nonzero fp32 activation gradients below 2^-24"]
    assert below.n == 2 and below.verdict == INCONCLUSIVE and 0 <= below.estimate <= 1
    assert f["cnn_deep: final eval loss, fp16 S=8 minus fp32"].n == 2
