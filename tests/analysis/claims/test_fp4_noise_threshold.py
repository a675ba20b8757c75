"""analysis/reproduce/claims/fp4_noise_threshold.py: the crossing step against the paper's threshold
re-stated in plain Python, each verdict on hand-made runs, real NVFP4 and BF16 run records, and the
claim's sweeps as the experiment composes them."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import ClaimRuns, load_claim_runs
from analysis.reproduce.claims.fp4_noise_threshold import (CLAIM, FP4, THRESHOLD, TWIN, WINDOW, crossing_step,
                                                           evaluate, gap_growth)
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from tests.experiments.runs import TINY, compose_cfg, read_rows, run_tiny


def _paper_crossing(steps: list[int], rel_err: list[float]) -> int | None:
    """sigma_critical = ||grad L|| / sqrt(3 d) (arXiv 2505.19115): with ||eps||^2 = d sigma^2 the noise
    is past it when ||g|| / ||eps|| < sqrt(3); the centre of the first window of WINDOW probes whose
    median is."""
    for i in range(len(steps) - WINDOW + 1):
        if statistics.median(1.0 / e for e in rel_err[i:i + WINDOW]) < math.sqrt(3):
            return steps[i + WINDOW // 2]
    return None


def _probes(rel_err: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"step": [10 * (i + 1) for i in range(len(rel_err))], "rel_err": rel_err})


def test_the_crossing_is_the_first_window_whose_median_ratio_is_below_sqrt3():
    rng = np.random.default_rng(0)
    for _ in range(200):
        err = list(rng.uniform(0.2, 0.9, size=int(rng.integers(1, 15))))
        frame = _probes(err)
        assert crossing_step(frame) == _paper_crossing(frame["step"].tolist(), err)
    assert THRESHOLD == pytest.approx(1.7320508)
    assert crossing_step(_probes([0.3] * 4 + [2.0] + [0.3] * 5)) is None  # one noisy probe is not a crossing
    assert crossing_step(_probes([0.3] * 4 + [0.7] * 6)) == 50  # window 30..70 holds 3 of 5 above 1/sqrt(3)


def test_gap_growth_reads_from_the_first_evaluation_at_or_after_the_crossing():
    fp4 = pd.Series({25: 2.0, 50: 1.9, 75: 1.95, 100: 1.97})
    twin = pd.Series({25: 1.8, 50: 1.75, 75: 1.74, 100: 1.72})
    gap, own, other = gap_growth(fp4, twin, cross=40)
    assert gap == pytest.approx((1.97 - 1.72) - (1.9 - 1.75)) and own == pytest.approx(0.07)
    assert other == pytest.approx(-0.03) and gap_growth(fp4, twin, cross=90) is None


def _runs(rel_err, widen: float, seeds: int = 10) -> ClaimRuns:
    """Per seed an NVFP4 run whose probes read ``rel_err(seed)`` and a BF16 twin; the NVFP4 eval loss
    drifts ``widen`` nats per 100 steps against its twin from step 100 on."""
    rng = np.random.default_rng(1)
    runs, fid, evals = [], [], []
    for seed in range(seeds):
        for prec in (FP4, TWIN):
            rid = f"{prec}-{seed}"
            runs.append({"run_id": rid, "precision": prec, "seed": seed, "status": "completed"})
            for step in range(25, 301, 25):
                drift = widen * max(step - 100, 0) / 100 if prec == FP4 else 0.0
                evals.append({"run_id": rid, "seed": seed, "step": step, "eval_loss": 2.0 - step / 1000 + drift
                              + 0.1 * (prec == FP4) + 0.002 * rng.standard_normal()})
        for i, e in enumerate(rel_err(seed)):
            fid.append({"run_id": f"{FP4}-{seed}", "seed": seed, "step": 10 * (i + 1), "rel_err": e})
    runset = SimpleNamespace(fidelity=pd.DataFrame(fid), evals=pd.DataFrame(evals))
    return ClaimRuns(runs=pd.DataFrame(runs), runset=runset)  # type: ignore[arg-type]


def _crosses_at_100(seed: int) -> list[float]:
    return [0.3] * 9 + [0.8] * 21  # rho 3.3 then 1.25: crossing at step 100


def test_a_gap_that_widens_after_the_crossing_reproduces_and_one_that_closes_does_not():
    up = evaluate(_runs(_crosses_at_100, widen=0.02))
    assert [f.verdict for f in up] == [REPRODUCED, REPRODUCED]
    assert up[0].estimate == 1.0 and "median crossing step 100" in up[0].note
    assert up[1].estimate == pytest.approx(0.04, abs=0.003) and up[1].n == 10  # 0.02 per 100 steps, 100 -> 300
    down = evaluate(_runs(_crosses_at_100, widen=-0.02))
    assert down[1].verdict == NOT_REPRODUCED and down[1].estimate == pytest.approx(-0.04, abs=0.003)


def test_no_crossing_is_not_reproduced_and_leaves_the_gap_without_seeds():
    never = evaluate(_runs(lambda seed: [0.3] * 30, widen=0.02))
    assert never[0].verdict == NOT_REPRODUCED and never[0].estimate == 0.0
    assert never[1].verdict == INCONCLUSIVE and never[1].n == 0
    few = evaluate(_runs(_crosses_at_100, widen=0.02, seeds=5))
    assert {f.verdict for f in few} == {INCONCLUSIVE}


def test_the_claim_is_registered_and_its_sweeps_compose_to_the_papers_nvfp4_and_a_bf16_twin():
    assert CLAIM in CLAIMS and CLAIM.experiment == "repro_fp4_noise_threshold"
    fp4, twin = (compose_cfg("+experiment=repro_fp4_noise_threshold", *s) for s in CLAIM.sweeps)
    b = fp4.precision.blocks
    assert fp4.precision.name == FP4 and list(b.keep) == [] and not b.activation.rht and not b.gradient.rht
    assert b.gradient.rounding == "stochastic" and b.activation.rounding == b.weight.rounding == "nearest"
    assert twin.precision.name == TWIN and fp4.train.fidelity_every == twin.train.fidelity_every == 10
    assert fp4.model.name == twin.model.name == "gpt_pretrained"


def test_the_ratio_and_the_gap_come_from_real_run_records(tmp_path):
    common = ("strategy=native", "train.steps=8", "train.log_every=2", "train.fidelity_every=1",
              "train.eval_every=2", "train.eval_batches=1")
    arms = {FP4: ("precision=nvfp4", "precision.blocks.activation.rht=false",
                  "precision.blocks.gradient.rht=false", "precision.blocks.keep=[]"), TWIN: ("precision=bf16",)}
    for prec, over in arms.items():
        run_dir = tmp_path / "sweep" / prec / "seed0"
        run_tiny(run_dir, *over, *common, model="gpt")
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_cfg(*TINY["gpt"], *over)))
    lines = [r for r in read_rows(tmp_path / "sweep" / FP4 / "seed0") if r["kind"] == "fidelity"]
    twin_err = [r["rel_err"] for r in read_rows(tmp_path / "sweep" / TWIN / "seed0") if r["kind"] == "fidelity"]
    assert len(lines) == 8 and all(0 < r["rel_err"] < 10 for r in lines)
    assert statistics.median(twin_err) < 0.1 * statistics.median(r["rel_err"] for r in lines)  # the FP4 noise
    runs = load_claim_runs(tmp_path / "sweep")
    fid = runs.runset.fidelity
    probes = fid[fid["run_id"] == runs.runs.set_index("precision").loc[FP4, "run_id"]]
    assert crossing_step(probes) == _paper_crossing([r["step"] for r in lines], [r["rel_err"] for r in lines])
    findings = evaluate(runs)
    assert [f.n for f in findings] == [1, findings[1].n] and {f.verdict for f in findings} == {INCONCLUSIVE}
