"""The report on real run records written by ``scalelab-train`` (subprocesses, tiny GPT).

The fast test runs 4 jobs in one subprocess (fp16 ``native`` and ``none`` × 2 seeds in the
``small_grad`` regime; ~15 s of CPU) and checks the report end to end and one real effect: without loss
scaling, fp16 activation gradients of a loss multiplied by 1e-6 underflow to zero. The slow test
runs the whole ``compare_tiny`` grid (36 jobs) like ``make compare`` does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import main

REPO = Path(__file__).resolve().parents[2]


def _train(sweep: Path, *args: str, timeout: float = 300) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "experiments.app.train", "-m", *args,
                           f"hydra.sweep.dir={sweep}", "logger=none"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _check_report(out: Path, n_runs: int) -> str:
    html = (out / "report.html").read_text(encoding="utf-8")
    pngs = sorted(p.name for p in (out / "figures").glob("*.png"))
    embedded = re.findall(r'<img alt="[^"]*" data-file="([^"]+)" src="data:image/png;base64,', html)
    assert pngs and sorted(embedded) == pngs
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == n_runs
    res = pd.read_csv(out / "results.csv")
    assert len(res) == runs.groupby(["workload", "precision", "strategy"]).ngroups
    return html


def test_report_on_a_tiny_real_sweep(tmp_path: Path, capsys):
    sweep = tmp_path / "sweep"
    common = ["regime=small_grad", "hydra/launcher=basic", "train.hist_every=2"]
    _train(sweep, "+experiment=compare_tiny", "strategy=native,none", "seed=0,1", *common)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--n-boot", "200"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    _check_report(out, n_runs=4)
    assert (out / "figures" / "exponents-gpt-stdlib-chars-small-grad-fp16.png").exists()
    runs = pd.read_csv(out / "runs.csv").set_index(["precision", "strategy", "seed"])
    assert (runs["status"] == "completed").all()
    # real effect: unscaled fp16 gradients of a 1e-6-scaled loss are (almost) all zero,
    # while native's 2^16 scale keeps them representable
    none = runs.loc[("fp16", "none"), "act_zero_frac_mean"]
    native = runs.loc[("fp16", "native"), "act_zero_frac_mean"]
    assert (none > 0.9).all() and (native < 0.5).all()
    comps = pd.read_csv(out / "comparisons.csv")
    zero = comps[(comps["strategy"] == "none") & (comps["metric"] == "act_zero_frac_mean")]
    assert zero["poi"].item() == 0.0  # every `none` run has more zeros than every native run


@pytest.mark.slow
def test_report_on_the_compare_tiny_grid(tmp_path: Path):
    """`make compare`'s three sweeps on the tiny grid: every strategy x 3 regimes in fp16, in fp8_e5m2,
    and the fp32 reference and bf16 control, 5 seeds each."""
    sweep = tmp_path / "sweep"
    _train(sweep, "+experiment=compare_tiny", timeout=1800)
    _train(sweep, "+experiment=compare_tiny", "precision=fp8_e5m2", "regime=plain", timeout=900)
    _train(sweep, "+experiment=compare_tiny", "precision=fp32,bf16", "strategy=none", timeout=900)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out)]) == 0
    html = _check_report(out, n_runs=len(list(sweep.rglob("summary.json"))))
    assert "Verdict:" in html
    res = pd.read_csv(out / "results.csv")
    assert set(res["workload"]) == {f"gpt/stdlib_chars/{r}" for r in ("plain", "tiny_grad", "spikes")}
    assert set(res["precision"]) == {"fp16", "fp8_e5m2", "fp32", "bf16"}
