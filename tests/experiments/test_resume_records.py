"""Resume and records (issue 20 §3), with real runs of the tiny configs: a changed ``train.steps``
continues only as the run of the new length (else one-line refusal), nothing recorded is lost when
a run starts over, a job submitit requeues says ``requeued`` (pending, not failed), and a forward
pass that overflows is called so, not a collapsed scale."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from submitit.core.job_environment import SignalHandler
from submitit.core.utils import DelayedSubmission, JobPaths
from submitit.slurm.slurm import SlurmJobEnvironment

import experiments.app.loop as loop
from analysis.load import load_runs
from experiments import schema
from experiments.app.build import ConfigError
from tests.experiments.runs import QUIET, REPO, TINY, cli, read_rows, run_tiny

TIMING = ("step_time_s", "strategy_time_s")


def _train(rows: list[dict]) -> list[dict]:
    """Train lines without wall times (the only fields two identical runs may differ in)."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows if r["kind"] == "train"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / schema.CHECKPOINT_NAME, weights_only=True)["model"]


def _records(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file() and p.name != schema.LOCK_NAME}


# ------------------------------------------------------------------ 1. train.steps on resume
COSINE = ["train.lr_decay=cosine", "train.lr_warmup=2", "train.log_every=1", "train.eval_every=0",
          "train.checkpoint_every=5"]


def test_a_changed_steps_under_a_decaying_schedule_is_refused_naming_old_and_new(tmp_path: Path) -> None:
    run_tiny(tmp_path, *COSINE, "train.steps=10")
    before = _records(tmp_path)
    with pytest.raises(ConfigError) as err:
        run_tiny(tmp_path, *COSINE, "train.steps=15")
    message = str(err.value)
    assert "\n" not in message and message.startswith("train.steps changed (10 -> 15)")
    assert "train.lr_decay=cosine" in message and "train.resume=false" in message
    assert _records(tmp_path) == before


def test_a_changed_steps_is_refused_before_hydra_writes(tmp_path: Path) -> None:
    run_tiny(tmp_path, *COSINE, "train.steps=10")
    before = _records(tmp_path)
    result = cli(*TINY["mlp"], *QUIET, *COSINE, "train.steps=15", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("scalelab-train: error: train.steps changed (10 -> 15)")
    assert not (tmp_path / ".hydra").exists() and _records(tmp_path) == before


@pytest.mark.parametrize("schedule,short", [
    # A constant rate does not depend on train.steps: any completed run continues.
    (["train.lr_decay=constant", "train.lr_warmup=3"], 6),
    # Cosine decays over train.steps - lr_warmup: a run still in its warmup (steps 1-6 of a
    # warmup of 8) ran at the longer run's rates, so it may continue as that run.
    (["train.lr_decay=cosine", "train.lr_warmup=8"], 6),
])
def test_a_continued_run_is_the_run_of_the_new_length_bit_for_bit(tmp_path: Path, schedule: list, short: int) -> None:
    args = [*schedule, "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=3", "precision=fp16"]
    ref, _ = run_tiny(tmp_path / "ref", *args, "train.steps=14")
    run_tiny(tmp_path / "run", *args, f"train.steps={short}")
    longer, rows = run_tiny(tmp_path / "run", *args, "train.steps=14")
    ref_rows = read_rows(tmp_path / "ref")
    assert [r["lr"] for r in _train(rows)] == [r["lr"] for r in _train(ref_rows)]  # the LR of every step
    assert _train(rows) == _train(ref_rows)  # losses, scales, gradient statistics
    weights, ref_weights = _weights(tmp_path / "run"), _weights(tmp_path / "ref")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert longer["steps"] == ref["steps"] == 14 and longer["final_eval_loss"] == ref["final_eval_loss"]


# ------------------------------------------------------------------ 2. nothing completed is lost
@pytest.mark.parametrize("how", ["checkpointing off", "checkpoint deleted"])
def test_a_record_without_a_checkpoint_is_moved_aside_before_a_new_start(tmp_path: Path, how: str, capfd) -> None:
    every = "train.checkpoint_every=0" if how == "checkpointing off" else "train.checkpoint_every=3"
    args = ["train.log_every=3", "train.eval_every=0", every]
    first, _ = run_tiny(tmp_path, *args, "train.steps=6")
    (tmp_path / schema.CHECKPOINT_NAME).unlink(missing_ok=True)
    before = _records(tmp_path)
    capfd.readouterr()
    second, rows = run_tiny(tmp_path, *args, "train.steps=9")
    assert f"no checkpoint to resume from: {tmp_path} starts at step 0" in capfd.readouterr().err
    assert second["status"] == "completed" and [r["step"] for r in _train(rows)] == [3, 6, 9]
    kept = tmp_path / f"{schema.REPLACED_PREFIX}1"
    assert {name: (kept / (name + schema.REPLACED_SUFFIX)).read_bytes() for name in before} == before
    old = json.loads((kept / (schema.SUMMARY_NAME + schema.REPLACED_SUFFIX)).read_text())
    assert old["status"] == "completed" and old["steps"] == 6 and old == json.loads(json.dumps(first))


def test_a_failed_record_without_a_checkpoint_is_kept_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["train.log_every=2", "train.eval_every=4", "train.checkpoint_every=0", "train.steps=6"]
    real = loop._evaluate
    monkeypatch.setattr(loop, "_evaluate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_tiny(tmp_path, *args)
    before = _records(tmp_path)
    monkeypatch.setattr(loop, "_evaluate", real)
    summary, _ = run_tiny(tmp_path, *args)
    kept = tmp_path / f"{schema.REPLACED_PREFIX}1"
    assert summary["status"] == "completed"
    assert {name: (kept / (name + schema.REPLACED_SUFFIX)).read_bytes() for name in before} == before
    assert json.loads(before[schema.SUMMARY_NAME])["status"] == "failed"


# ------------------------------------------------------------------ 3. requeued by submitit
class Requeueable:
    """A submitit callable that can be requeued, as hydra-submitit-launcher's ``BaseSubmititLauncher``."""

    def __call__(self) -> None:
        return None

    def checkpoint(self) -> DelayedSubmission:
        return DelayedSubmission(self)


REQUEUE = ["train.steps=12", "train.log_every=2", "train.eval_every=6", "train.checkpoint_every=5",
           "train.lr_decay=constant"]


@pytest.fixture()
def slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The process as submitit starts a SLURM job: its environment, its preemption handler on
    SIGUSR2 (submitit's own ``SignalHandler``), and ``scontrol`` (a stand-in that logs its
    arguments). Yields ``(handler's DelayedSubmission, scontrol log)``."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    delayed = DelayedSubmission(Requeueable())
    delayed.set_timeout(60, 3)
    (tmp_path / "submitit").mkdir()
    handler = SignalHandler(SlurmJobEnvironment(), JobPaths(tmp_path / "submitit", job_id="4242"), delayed)
    previous = signal.signal(signal.SIGUSR2, handler.checkpoint_and_try_requeue)
    yield delayed, log
    signal.signal(signal.SIGUSR2, previous)


def _signal_at_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM's preemption signal arrives during the first evaluation (step 6)."""
    real = loop._evaluate
    sent: list[int] = []

    def evaluate(*args, **kwargs):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGUSR2)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "_evaluate", evaluate)


def test_a_requeued_job_says_requeued_and_resumes_as_if_never_stopped(tmp_path: Path, slurm_job, monkeypatch) -> None:
    _, log = slurm_job
    run_dir = tmp_path / "run"
    ref, _ = run_tiny(tmp_path / "ref", *REQUEUE)
    _signal_at_eval(monkeypatch)
    with pytest.raises(SystemExit) as stop:  # what submitit does after requeuing: sys.exit(-1)
        run_tiny(run_dir, *REQUEUE)
    assert stop.value.code == -1
    assert log.read_text().split() == ["requeue", "4242"]
    summary = json.loads((run_dir / schema.SUMMARY_NAME).read_text())
    assert summary["status"] == "requeued" and "requeued" in schema.STATUSES
    assert summary["error"] == ("SIGUSR2 at step 6 (preemption or time limit): submitit requeued the job, "
                                "which resumes from step 5")
    assert signal.getsignal(signal.SIGUSR2).__self__.__class__ is SignalHandler  # submitit's handler is back
    # The report counts it as pending (incomplete), not failed.
    runs = load_runs(run_dir).runs
    assert list(runs["status"]) == ["incomplete"] and list(runs["summary_status"]) == ["requeued"]
    # The requeued job runs again in the same directory (no second signal) and ends as the
    # uninterrupted run.
    resumed, rows = run_tiny(run_dir, *REQUEUE)
    assert resumed["status"] == "completed" and resumed["final_eval_loss"] == ref["final_eval_loss"]
    assert _train(rows) == _train(read_rows(tmp_path / "ref"))


def test_a_job_submitit_does_not_requeue_is_failed(tmp_path: Path, slurm_job, monkeypatch) -> None:
    delayed, log = slurm_job
    delayed.set_timeout(0, 0)  # timed out, no requeue left: submitit raises UncompletedJobError
    _signal_at_eval(monkeypatch)
    with pytest.raises(Exception, match="timed-out too many times"):
        run_tiny(tmp_path, *REQUEUE)
    summary = json.loads((tmp_path / schema.SUMMARY_NAME).read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("UncompletedJobError: Job not requeued")
    assert not log.exists()


def test_a_sys_exit_outside_the_preemption_handler_is_a_failure(tmp_path: Path, slurm_job, monkeypatch) -> None:
    def evaluate(*args, **kwargs):
        raise SystemExit(-1)

    monkeypatch.setattr(loop, "_evaluate", evaluate)
    with pytest.raises(SystemExit):
        run_tiny(tmp_path, *REQUEUE)
    summary = json.loads((tmp_path / schema.SUMMARY_NAME).read_text())
    assert summary["status"] == "failed" and summary["error"] == "SystemExit: -1"


def _slurm_answers() -> bool:
    """A SLURM controller answers ``sinfo``."""
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _wait(what: str, check, launcher: subprocess.Popen, log: Path, timeout: float = 300.0):
    """Poll ``check()`` until it returns something truthy, while ``launcher`` runs (``timeout``: a
    hang guard, not a measurement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        if launcher.poll() is not None:
            raise AssertionError(f"the sweep ended before {what}: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout:.0f} s")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs a SLURM cluster (sbatch)")
def test_a_job_slurm_requeues_says_requeued_then_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Real SLURM (e.g. a single-node cluster: ``apt-get install slurm-wlm munge``): a sweep job
    preempted with ``scancel --signal=USR2`` is requeued by submitit; until it runs again its
    summary says ``requeued``, then it resumes from its checkpoint and completes."""
    if not _slurm_answers():
        pytest.skip("sbatch is installed but no SLURM controller answers sinfo")
    sweep, steps = tmp_path / "sweep", 3000
    args = ["-m", *TINY["mlp"], *QUIET, f"train.steps={steps}", "train.log_every=20", "train.eval_every=0",
            "train.checkpoint_every=100", "train.lr_decay=constant", "hydra/launcher=slurm",
            "hydra.launcher.gpus_per_task=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
            f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "experiments.app.train", *args], cwd=REPO, env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
    run_dir, job = sweep / "0", None
    try:
        job = _wait("submitit job folder", lambda: [p.name for p in (sweep / ".submitit").glob("*")  # <job id>[_<task>]
                                                    if p.is_dir() and re.fullmatch(r"\d+(_\d+)?", p.name)],
                    launcher, log)[0]
        _wait("train line at step >= 200", lambda: [r for r in _train_so_far(run_dir) if r["step"] >= 200],
              launcher, log)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=60)
        summary = _wait("requeued summary", lambda: _summary_if(run_dir, "requeued"), launcher, log, timeout=120)
        at, resume = map(int, re.fullmatch(r"SIGUSR2 at step (\d+) \(preemption or time limit\): submitit requeued "
                                           r"the job, which resumes from step (\d+)", summary["error"]).groups())
        assert 200 <= resume <= at < steps and resume % 100 == 0
        assert list(load_runs(run_dir).runs["status"]) == ["incomplete"]  # pending, not failed
        assert "Restarts=1" in subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                                              timeout=60).stdout
        # SLURM holds a requeued job ~2 minutes (BeginTime); let it start now.
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, timeout=60)
        assert launcher.wait(timeout=600) == 0, log.read_text()[-2000:]
    finally:
        if launcher.poll() is None:
            if job is not None:
                subprocess.run(["scancel", job], timeout=60)
            launcher.kill()
    final = json.loads((run_dir / schema.SUMMARY_NAME).read_text())
    assert final["status"] == "completed" and final["steps"] == steps
    assert [r["step"] for r in read_rows(run_dir) if r["kind"] == "train"] == list(range(20, steps + 1, 20))


def _summary_if(run_dir: Path, status: str) -> dict | None:
    """The run's summary once it says ``status`` (``None`` before, or while it is being replaced)."""
    try:
        summary = json.loads((run_dir / schema.SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == status else None


def _train_so_far(run_dir: Path) -> list[dict]:
    """The train lines written so far (none while the file does not exist)."""
    try:
        return [r for r in read_rows(run_dir) if r["kind"] == "train"]
    except (OSError, ValueError):
        return []


# ------------------------------------------------------------------ 4. forward overflow
# model.init_scale=1e4: the first layer's fp16 outputs exceed 65504 from step 1, whatever S.
OVERFLOW = ["precision=fp16", "model.init_scale=1e4", "train.steps=20", "train.eval_every=0"]


@pytest.mark.parametrize("init_scale", ["1", "65536"])
@pytest.mark.parametrize("stop,at", [(["train.log_every=50", "train.max_consecutive_skips=6"], 6),  # the stall check
                                     (["train.log_every=3", "train.max_consecutive_skips=100"], 3)])  # a logged loss
def test_a_forward_overflow_is_called_so_not_a_collapsed_scale(tmp_path: Path, stop: list, at: int,
                                                               init_scale: str) -> None:
    summary, rows = run_tiny(tmp_path, *OVERFLOW, *stop, "strategy=static", f"strategy.init_scale={init_scale}")
    assert summary["status"] == "stalled" and summary["steps"] == at and summary["skipped_steps"] == at
    assert summary["error"].startswith("forward overflow: the loss is non-finite before scaling (")
    assert f"at step {at}, the last of {at} skipped steps in a row" in summary["error"]
    assert "collapsed" not in summary["error"] and "\n" not in summary["error"] and summary["diverged"] is False


def test_the_same_model_in_fp32_has_a_finite_loss(tmp_path: Path) -> None:
    """The control: the overflow above is fp16's range, not a broken model."""
    _, rows = run_tiny(tmp_path, *OVERFLOW[1:], "precision=fp32", "strategy=none", "train.steps=1",
                       "train.log_every=1", "train.divergence_loss=1e30")
    assert torch.isfinite(torch.tensor(rows[0]["loss"]))
