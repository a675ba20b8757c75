"""Issue 29, the run records of a resumed run: each segment of a run (every process that ran part
of it) records the code, torch and host it ran on; a run killed mid-way and resumed with another
``train.steps`` under a decaying schedule is refused, or (where the rates of the steps already run
are the new length's) recorded with the ``train.steps`` of each segment."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from analysis.load import load_runs
from experiments import schema
from experiments.app import records
from tests.experiments.runs import QUIET, TINY, cli, run_tiny

ARGS = ["train.steps=9", "train.log_every=3", "train.eval_every=0", "train.checkpoint_every=3"]


def _kill(run_dir: Path, *args: str, at: int) -> None:
    """A ``scalelab-train`` process of the tiny MLP SIGKILLed at step ``at``."""
    killed = cli(*TINY["mlp"], *QUIET, *args, f"train.kill_at_step={at}", f"hydra.run.dir={run_dir}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def _elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process runs "other code": another commit and torch version, on another host."""
    real = records.fingerprint
    monkeypatch.setattr(records, "fingerprint", lambda *a: {**real(*a), "git_sha": "f" * 40, "git_dirty": True,
                                                            "torch_version": "9.9.9", "hostname": "elsewhere"})


def test_each_segment_records_the_code_torch_and_host_it_ran_on(tmp_path: Path, monkeypatch) -> None:
    _kill(tmp_path, *ARGS, at=7)  # checkpoint at step 6
    first = json.loads((tmp_path / schema.SUMMARY_NAME).read_text())["segments"]
    here = records.fingerprint({}, [], "cpu")
    assert first == [{"start_step": 0, "steps": 9, "git_sha": here["git_sha"], "git_dirty": here["git_dirty"],
                      "torch_version": torch.__version__, "device": "cpu", "hostname": here["hostname"]}]
    _elsewhere(monkeypatch)
    summary, _ = run_tiny(tmp_path, *ARGS)
    assert summary["status"] == "completed" and summary["steps"] == 9
    assert summary["segments"] == first + [{"start_step": 6, "steps": 9, "git_sha": "f" * 40, "git_dirty": True,
                                            "torch_version": "9.9.9", "device": "cpu", "hostname": "elsewhere"}]
    assert json.loads((tmp_path / schema.SUMMARY_NAME).read_text())["segments"] == summary["segments"]
    # The report lists the run as resumed on other code, with both versions.
    issues = load_runs(tmp_path).runs.iloc[0]["issues"]
    assert issues == (f"resumed on other code: from step 0 git {(here['git_sha'] or '?')[:12]} torch "
                      f"{torch.__version__}; from step 6 git ffffffffffff torch 9.9.9")


def test_a_segment_whose_steps_were_dropped_is_not_listed(tmp_path: Path) -> None:
    _kill(tmp_path, *ARGS, at=7)  # checkpoint at step 6
    _kill(tmp_path, *ARGS, at=8)  # resumed at 6, killed before another checkpoint: steps 7-8 are dropped
    summary, rows = run_tiny(tmp_path, *ARGS)
    assert [s["start_step"] for s in summary["segments"]] == [0, 6]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [3, 6, 9]
    assert load_runs(tmp_path).runs.iloc[0]["issues"] is None  # one code, one torch: nothing to say


def test_a_checkpoint_from_before_segments_takes_the_first_from_the_summary(tmp_path: Path) -> None:
    _kill(tmp_path, *ARGS, at=7)
    path = tmp_path / schema.CHECKPOINT_NAME
    state = torch.load(path, weights_only=True)
    del state["segments"]  # as written before issue 29
    torch.save(state, path)
    old = json.loads((tmp_path / schema.SUMMARY_NAME).read_text())["fingerprint"]
    summary, _ = run_tiny(tmp_path, *ARGS)
    assert summary["segments"][0] == {"start_step": 0, "steps": 9, **{k: old[k] for k in schema.SEGMENT_KEYS[2:]}}
    assert [s["start_step"] for s in summary["segments"]] == [0, 6]


COSINE = ["train.lr_decay=cosine", "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=5"]


def test_killed_at_25_of_40_and_resumed_with_30_steps_under_cosine_is_refused(tmp_path: Path) -> None:
    """The issue's case: steps 1-25 ran on the 40-step schedule; continuing as 30 steps is refused with
    one line naming train.steps and the schedule, before anything is written."""
    _kill(tmp_path, *COSINE, "train.lr_warmup=2", "train.steps=40", at=25)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != schema.LOCK_NAME}
    result = cli(*TINY["mlp"], *QUIET, *COSINE, "train.lr_warmup=2", "train.steps=30", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.startswith("scalelab-train: error: train.steps changed (40 -> 30) but the learning-rate "
                                    "schedule depends on it (train.lr_decay=cosine): steps 1-25 in ")
    assert result.stderr.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != schema.LOCK_NAME} == before


def test_a_changed_steps_the_schedule_allows_is_recorded_per_segment(tmp_path: Path) -> None:
    """Still in its warmup (8 steps), a run killed at step 6 of 40 ran at the rates of a 30-step run:
    it continues as one, and its segments say which train.steps each part was started with."""
    _kill(tmp_path, *COSINE, "train.lr_warmup=8", "train.steps=40", at=6)
    summary, _ = run_tiny(tmp_path, *COSINE, "train.lr_warmup=8", "train.steps=30")
    assert summary["steps"] == 30
    assert [(s["start_step"], s["steps"]) for s in summary["segments"]] == [(0, 40), (5, 30)]
