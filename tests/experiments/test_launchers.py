"""Multirun sweeps through each launcher leave one complete run record per job.

``scalelab-train -m strategy=glob(*) seed=0,1`` (every strategy YAML, `none` included, x 2 seeds)
on a tiny character GPT for a few steps, in a subprocess, with

- the basic launcher (Hydra's default: jobs run one after another in the calling process),
- ``hydra/launcher=parallel`` (hydra-joblib-launcher, 2 worker processes), through the
  ``compare_tiny`` experiment, which selects that launcher,
- ``hydra/launcher=slurm_local`` (hydra-submitit-launcher's local executor: jobs pickled and run
  as separate processes, exactly as on SLURM). Every job is a fresh Python process that imports
  torch, so the full grid is marked slow; a two-job sweep runs in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments.app.train import group_options
from tests.experiments.runs import QUIET, TINY, cli

FEW_STEPS = ["train.steps=4", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=0", "train.hist_every=0"]


def _records(sweep_dir: Path) -> dict[tuple[str, int], dict]:
    """(strategy, seed) -> summary of every run under ``sweep_dir``, after checking its record."""
    found: dict[tuple[str, int], dict] = {}
    for summary_path in sorted(sweep_dir.rglob("summary.json")):
        run_dir = summary_path.parent
        summary = json.loads(summary_path.read_text())
        assert summary["status"] == "completed", f"{run_dir}: {summary['status']} {summary.get('error')}"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in train_rows] == [2, 4], f"{run_dir}: logged steps {[r['step'] for r in train_rows]}"
        assert any(r["kind"] == "eval" for r in rows), f"{run_dir}: no eval line"
        assert (run_dir / ".hydra" / "overrides.yaml").exists()
        key = (_choice(run_dir), summary["seed"])
        assert key not in found, f"two run records for {key}"
        found[key] = summary
    return found


def _choice(run_dir: Path) -> str:
    """The strategy config-group choice (file name in conf/strategy) a run was started with."""
    hydra_cfg = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())
    return hydra_cfg["hydra"]["runtime"]["choices"]["strategy"]


def _launcher_target(sweep_dir: Path) -> str:
    return yaml.safe_load((sweep_dir / "multirun.yaml").read_text())["hydra"]["launcher"]["_target_"]


def _sweep(tmp_path: Path, *args: str, timeout: float = 300) -> Path:
    sweep_dir = tmp_path / "sweep"
    proc = cli("-m", *args, f"hydra.sweep.dir={sweep_dir}", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "stderr.txt").write_text(proc.stderr)
    return sweep_dir


def _expect_progress(tmp_path: Path, records: dict[tuple[str, int], dict]) -> None:
    """experiments/app/progress.py: one line per finished job, counted 1..N across the workers, naming it."""
    lines = [ln for ln in (tmp_path / "stderr.txt").read_text().splitlines() if ln.startswith("[")
             and "/" in ln.split("]")[0] and " ETA " in ln]
    n = len(records)
    assert sorted(int(ln[1:].split("/")[0]) for ln in lines) == list(range(1, n + 1))
    assert all(ln.split("]")[0].endswith(f"/{n}") for ln in lines)
    named = sorted((ln.split("]")[1].split()[2], int(ln.split(" seed ")[1].split(":")[0])) for ln in lines)
    assert named == sorted((r["strategy"], r["seed"]) for r in records.values())


def _expect_grid(sweep_dir: Path, strategies: list[str], seeds: list[int]) -> dict[tuple[str, int], dict]:
    records = _records(sweep_dir)
    assert sorted(records) == sorted((s, k) for s in strategies for k in seeds)
    return records


def test_basic_launcher_one_record_per_job(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path, "strategy=glob(*)", "seed=0,1", *TINY["gpt"], *QUIET, *FEW_STEPS)
    assert _launcher_target(sweep).endswith("BasicLauncher")
    records = _expect_grid(sweep, group_options("strategy"), [0, 1])
    _expect_progress(tmp_path, records)
    # the seed reaches the run: same strategy, different seeds, different losses
    assert records[("native", 0)]["final_train_loss"] != records[("native", 1)]["final_train_loss"]


def test_joblib_launcher_one_record_per_job(tmp_path: Path) -> None:
    """compare_tiny selects hydra/launcher=parallel; `regime=plain seed=0,1` narrow its grid."""
    sweep = _sweep(tmp_path, "+experiment=compare_tiny", "regime=plain", "strategy=glob(*)", "seed=0,1",
                   *QUIET, *FEW_STEPS)
    assert _launcher_target(sweep).endswith("JoblibLauncher")
    records = _expect_grid(sweep, group_options("strategy"), [0, 1])
    _expect_progress(tmp_path, records)  # from two worker processes
    # compare's run-directory layout: <regime>/<precision>-<strategy>/seed<k>
    for strategy, seed in records:
        assert (sweep / "plain" / f"fp16-{strategy}" / f"seed{seed}" / "summary.json").exists()
    assert {r["sweep"] for r in records.values()} == {"compare_tiny"}


def _submitit(tmp_path: Path, strategy: str, seeds: str) -> Path:
    sweep = _sweep(tmp_path, "hydra/launcher=slurm_local", f"strategy={strategy}", f"seed={seeds}",
                   *TINY["gpt"], *QUIET, *FEW_STEPS, timeout=600)
    assert _launcher_target(sweep).endswith("LocalLauncher")
    assert list((sweep / ".submitit").iterdir()), "submitit wrote no job folders"
    return sweep


def test_submitit_local_launcher_two_jobs(tmp_path: Path) -> None:
    sweep = _submitit(tmp_path, "native,none", "0")
    _expect_grid(sweep, ["native", "none"], [0])


@pytest.mark.slow
def test_submitit_local_launcher_one_record_per_job(tmp_path: Path) -> None:
    sweep = _submitit(tmp_path, "glob(*)", "0,1")
    _expect_grid(sweep, group_options("strategy"), [0, 1])
