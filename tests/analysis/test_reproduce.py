"""``scalelab-reproduce`` (analysis/reproduce/cli.py): claim selection, the exact sweep command
lines, the sweep environment, going on past a failed sweep, and (slow) a real toy claim end to
end with a cheap re-run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import analysis.reproduce.claims as registry
from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, direction, paired_values
from analysis.reproduce.page import read_record
from analysis.reproduce import cli as reproduce
from tests.analysis.fake_claims import BROKEN, FAKE_CLAIMS, GOOD, write_fake_runs

# A stand-in for scalelab-train: logs its arguments and environment, fails for the broken claim.
FAKE_TRAIN = (sys.executable, "-c", (
    "import json, os, sys\n"
    "with open(os.environ['FAKE_TRAIN_LOG'], 'a') as fh:\n"
    "    fh.write(json.dumps({'args': sys.argv[1:], 'omp': os.environ.get('OMP_NUM_THREADS'),"
    " 'wandb': os.environ.get('WANDB_MODE')}) + '\\n')\n"
    "sys.exit(3 if '+experiment=repro_broken' in sys.argv else 0)\n"))


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> list[Claim]:
    monkeypatch.setattr(registry, "CLAIMS", list(FAKE_CLAIMS))
    return FAKE_CLAIMS


def test_the_sweep_command_lines_of_a_claim_full_and_quick() -> None:
    assert reproduce.sweep_args(GOOD, "runs/reproduce", quick=False) == [
        ["-m", "+experiment=repro_good", "hydra.sweep.dir=runs/reproduce/good", "precision=fp16",
         "strategy=max_ema,native"],
        ["-m", "+experiment=repro_good", "hydra.sweep.dir=runs/reproduce/good", "precision=fp32",
         "strategy=none"],
    ]
    assert reproduce.sweep_args(GOOD, "runs/q", quick=True) == [
        ["-m", "+experiment=repro_good", "hydra.sweep.dir=runs/q/good", "precision=fp16",
         "strategy=max_ema,native", "seed=0,1", "train.steps=4"],
        ["-m", "+experiment=repro_good", "hydra.sweep.dir=runs/q/good", "precision=fp32",
         "strategy=none", "seed=0,1", "train.steps=4"],
    ]
    # the default sweep is the experiment's own grid, once; experiment may name another config
    assert reproduce.sweep_args(BROKEN, "o", quick=True) == [
        ["-m", "+experiment=repro_broken", "hydra.sweep.dir=o/broken"]]
    other = Claim("x", "t", "s", "c", (), lambda r: [], experiment="compare_tiny")
    assert reproduce.sweep_args(other, "o", quick=False) == [
        ["-m", "+experiment=compare_tiny", "hydra.sweep.dir=o/x"]]


def test_the_sweeps_run_single_threaded_and_offline_unless_told() -> None:
    env = reproduce.train_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    assert reproduce.train_env({"WANDB_MODE": "disabled"})["WANDB_MODE"] == "disabled"


def test_claims_are_selected_by_name_in_registry_order() -> None:
    assert reproduce.select_claims(None, FAKE_CLAIMS) == FAKE_CLAIMS
    assert reproduce.select_claims("absent, good", FAKE_CLAIMS) == [FAKE_CLAIMS[0], FAKE_CLAIMS[2]]
    with pytest.raises(ValueError, match="^unknown claim 'nope'; known claims: good, broken, absent$"):
        reproduce.select_claims("good,nope", FAKE_CLAIMS)
    with pytest.raises(ValueError, match="known claims: none registered"):
        reproduce.select_claims("good", [])


def test_the_cli_refuses_an_unknown_claim_in_one_line(fake_registry, tmp_path: Path, capsys) -> None:
    assert reproduce.main(["--claims", "adaloss", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == "scalelab-reproduce: error: unknown claim 'adaloss'; known claims: good, broken, absent\n"
    assert not (tmp_path / "o").exists()


def test_a_failed_sweep_is_reported_and_the_other_claims_still_run(
        fake_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    log = tmp_path / "train.log"
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(log))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "out"
    write_fake_runs(out)
    failed = reproduce.run_claims(FAKE_CLAIMS, str(out), True, "scalelab-reproduce --quick", FAKE_TRAIN)
    assert failed == 1
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["args"] for c in calls] == [a for c in FAKE_CLAIMS for a in reproduce.sweep_args(c, out, True)]
    assert {(c["omp"], c["wandb"]) for c in calls} == {("1", "offline")}
    err = capsys.readouterr().err
    assert "scalelab-reproduce: [claim 1/3] good: the good claim -- 2 sweep(s)" in err
    assert "[claim 3/3] absent" in err  # after the failed claim 2
    assert "broken: sweep exited with status 3" in err
    record = read_record(out)
    assert record["command"] == "scalelab-reproduce --quick" and record["quick"] is True
    assert [s["rc"] for s in record["claims"]["broken"]["sweeps"]] == [3]
    assert [s["rc"] for s in record["claims"]["good"]["sweeps"]] == [0, 0]


def test_report_only_trains_nothing_and_quick_never_touches_the_committed_page(
        fake_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write_fake_runs(tmp_path / "runs" / "reproduce_quick")
    assert reproduce.main(["--quick", "--report-only"]) == 0
    page = tmp_path / "reports" / "reproduce_quick" / "reproductions.md"
    assert capsys.readouterr().out == "reports/reproduce_quick/reproductions.md\n"
    assert "| good (3 run(s) failed or unfinished) | final eval loss" in page.read_text()
    assert not (tmp_path / "docs").exists()
    assert not (tmp_path / "runs" / "reproduce_quick" / "reproduce.json").exists()


def test_an_interrupted_run_says_how_to_resume(fake_registry, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "run_claims", interrupted)
    assert reproduce.main(["--out", str(tmp_path / "o"), "--doc", str(tmp_path / "p.md")]) == 130
    assert "the same command resumes" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()


REPO = Path(__file__).resolve().parents[2]


def test_the_console_script_and_the_make_target_start_the_runner() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["scalelab-reproduce"] == "analysis.reproduce.cli:main"
    if shutil.which("make") is None:
        pytest.skip("no make")

    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}

    def dry(*extra: str) -> str:  # under `make test` the outer make's flags would print directories
        proc = subprocess.run(["make", "--no-print-directory", "-n", "reproduce", *extra], cwd=REPO,
                              capture_output=True, text=True, check=True, env=env)
        return [line.strip() for line in proc.stdout.splitlines() if "scalelab-reproduce" in line][-1]

    assert dry().endswith("OMP_NUM_THREADS=1 .venv/bin/scalelab-reproduce")
    assert dry("QUICK=1").endswith("OMP_NUM_THREADS=1 .venv/bin/scalelab-reproduce --quick")
    assert "make reproduce" in subprocess.run(["make", "help"], cwd=REPO, capture_output=True,
                                              text=True, check=True).stdout


def _evaluate_selftest(runs: ClaimRuns) -> list[Finding]:
    a, b = paired_values(runs.runs, {"strategy": "static"}, {"strategy": "native"})
    return [direction("final eval loss, static minus native", "static lower (toy)", a, b, "lower")]


SELFTEST = Claim(name="selftest", title="the runner on a real sweep", source="none", claim="toy",
                 deviations=("toy size",), evaluate=_evaluate_selftest, experiment="compare_tiny",
                 sweeps=(("regime=plain", "strategy=native,static", "logger=none"),),
                 quick=("seed=0,1",))


@pytest.mark.slow
def test_a_real_claim_end_to_end_and_a_rerun_trains_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setattr(registry, "CLAIMS", [SELFTEST])
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out, doc = tmp_path / "runs", tmp_path / "page.md"
    args = ["--quick", "--out", str(out), "--doc", str(doc)]
    assert reproduce.main(args) == 0
    err = capfd.readouterr().err
    assert "[claim 1/1] selftest" in err and "[4/4] fp16 plain" in err  # the sweep's progress lines
    first = doc.read_bytes()
    text = first.decode()
    assert "| selftest | final eval loss, static minus native | static lower (toy) |" in text
    assert "| 2 | inconclusive |" in text  # 2 seeds < MIN_PAIRS
    assert f"**Runs:** 4 under `{out}/selftest` (4 completed)" in text
    summaries = sorted(out.glob("selftest/*/*/seed*/summary.json"))
    assert len(summaries) == 4
    stamps = [p.stat().st_mtime_ns for p in summaries]
    assert reproduce.main(args) == 0
    err = capfd.readouterr().err
    assert err.count("already completed at step 6") == 4
    assert [p.stat().st_mtime_ns for p in summaries] == stamps  # nothing retrained
    assert doc.read_bytes() == first
    assert reproduce.main([*args, "--report-only"]) == 0
    assert doc.read_bytes() == first
