"""Issue 20 §2: no override makes Hydra run code, load code or steer programs — the ``hydra``
node included (``experiments/app/config_safety.py``, checked by ``experiments.app.train.check_safety``
before Hydra builds anything)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.app import records
from experiments.app.train import check_safety
from tests.experiments.runs import QUIET, TINY, cli

MARKER_MODULE = "tests.experiments.marker_target"
MARK = f"{MARKER_MODULE}.Marker"
FEW = ["train.steps=2", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0", "train.hist_every=0"]

# (command line, start of the one-line error)
ATTACKS = [
    # instantiated by Hydra: callbacks, launcher, sweeper, and anything nested in them
    ([f"+hydra.callbacks.x._target_={MARK}"], f"hydra.callbacks.x._target_='{MARK}' is not allowed (names nothing"),
    (["+hydra.callbacks.x._target_=os.system", "+hydra.callbacks.x.command=touch /tmp/x"],
     "hydra.callbacks.x._target_='os.system' is not allowed (resolves to posix.system)"),
    (["hydra.callbacks.progress._target_=experiments.app.records.write_json_atomic"],
     "hydra.callbacks.progress._target_='experiments.app.records.write_json_atomic' is not allowed (resolves to"),
    (["-m", f"hydra.launcher._target_={MARK}"], f"hydra.launcher._target_='{MARK}' is not allowed"),
    (["-m", "hydra.launcher._target_=experiments.app.progress.SweepProgress"],
     "hydra.launcher._target_='experiments.app.progress.SweepProgress' is not allowed (resolves to experiments.app.progress.SweepProgress)"),
    (["-m", "hydra/launcher=joblib", f"+hydra.launcher.x._target_={MARK}"],
     f"hydra.launcher.x._target_='{MARK}' is not allowed (names nothing the app loads); allowed: none"),
    (["-m", "hydra/launcher=slurm_local", "+hydra.launcher.x._target_=subprocess.run"],
     "hydra.launcher.x._target_='subprocess.run' is not allowed"),
    (["-m", f"hydra.sweeper._target_={MARK}"], f"hydra.sweeper._target_='{MARK}' is not allowed"),
    (["-m", "+hydra.sweeper.x._target_=os.system"], "hydra.sweeper.x._target_='os.system' is not allowed"),
    ([f"+hydra.job.config.x._target_={MARK}"], f"hydra.job.config.x._target_='{MARK}' is not allowed"),
    # a target synthesised by an interpolation is judged by what it resolves to, in its place
    (["+hydra.callbacks.x=\"${oc.decode:'{_target_: os.system}'}\""], "hydra.callbacks.x._target_='os.system' is not allowed"),
    (["+hydra.callbacks.x=${optimizer}"], "hydra.callbacks.x._target_='torch.optim.AdamW' is not allowed (resolves to"),
    # the app's own targets, swept (checked on a covering sample of the jobs before launch)
    (["-m", f"strategy._target_=strategies.create,{MARK}"], f"strategy._target_='{MARK}' is not allowed"),
    # logging.config.dictConfig: factories, classes, ext:// imports, log files outside the run
    ([f"hydra.job_logging.handlers.console.class={MARK}"], f"hydra.job_logging.handlers.console.class='{MARK}' is not allowed"),
    (["+hydra.hydra_logging.formatters.simple.class=subprocess.Popen"],
     "hydra.hydra_logging.formatters.simple.class='subprocess.Popen' is not allowed"),
    (["hydra.job_logging.handlers.console.stream=ext://antigravity.fly"],
     "hydra.job_logging.handlers.console.stream='ext://antigravity.fly' is not allowed"),
    (["hydra.job_logging.handlers.file.filename=/tmp/elsewhere.log"], "hydra.job_logging.handlers.file.filename='/tmp/elsewhere.log' is not allowed"),
    (["hydra.job.name=../../x"], "hydra.job_logging.handlers.file.filename="),
    # the job's environment: what git, the linker, Python or a shell read
    (["+hydra.job.env_set.GIT_DIR=/tmp"], "hydra.job.env_set.GIT_DIR: setting 'GIT_DIR' for the job is not allowed"),
    (["+hydra.job.env_set.GIT_CONFIG_COUNT=1"], "hydra.job.env_set.GIT_CONFIG_COUNT: setting"),
    (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], "hydra.job.env_set.LD_PRELOAD: setting"),
    (["+hydra.job.env_set.PYTHONSTARTUP=/tmp/x.py"], "hydra.job.env_set.PYTHONSTARTUP: setting"),
    (["+hydra.job.env_set.PATH=/tmp"], "hydra.job.env_set.PATH: setting"),
    (["+hydra.job.env_set.CXX=/tmp/cc"], "hydra.job.env_set.CXX: setting"),
    (["-m", "hydra.job.env_copy=[HOME]"], "hydra.job.env_set.HOME: setting 'HOME'"),  # Hydra copies it into env_set
    # files and shell lines
    (["hydra.output_subdir=/tmp/elsewhere"], "hydra.output_subdir='/tmp/elsewhere' is not allowed"),
    (["hydra.output_subdir=../up"], "hydra.output_subdir='../up' is not allowed"),
    (["-m", "hydra/launcher=slurm", "+hydra.launcher.setup=[touch /tmp/x]"], "'+hydra.launcher.setup=[touch /tmp/x]' is not allowed"),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.additional_parameters={wrap: x}"], "'hydra.launcher.additional_parameters"),
    # another config tree: Hydra reads it (and imports a pkg:// search path's package) while composing
    (["hydra.searchpath=[pkg://antigravity]"], "'hydra.searchpath=[pkg://antigravity]' is not allowed: the config tree is"),
    (["+hydra.searchpath=[file:///tmp]"], "'+hydra.searchpath=[file:///tmp]' is not allowed"),
    (["--config-path", "pkg://antigravity"], "--config-path='pkg://antigravity' is not allowed"),
    (["--config-dir", "/tmp"], "--config-dir='/tmp' is not allowed: the config tree is the environment's choice"),
    (["--experimental-rerun", "run/.hydra/config.pickle"], "--experimental-rerun is not allowed"),
    # not only when running: --help and --cfg compose (and --help configures Hydra's logging)
    (["--help", "hydra.hydra_logging.handlers.console.class=os.system"], "hydra.hydra_logging.handlers.console.class='os.system'"),
]

LEGITIMATE = [
    [],
    ["-m", "seed=0,1", "strategy=native,static"],
    ["-m", "hydra/launcher=joblib"],
    ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=1"],
    ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
    ["-m", "hydra/launcher=slurm_local"],
    ["-m", "hydra/launcher=submitit_local"],
    ["-m", "hydra/sweeper=basic"],
    ["-m", "experiment=compare_tiny"],
    ["hydra/job_logging=disabled"],
    ["hydra/job_logging=stdout", "hydra/hydra_logging=hydra_debug"],
    ["+hydra.job.env_set.OMP_NUM_THREADS=1", "+hydra.job.env_set.CUBLAS_WORKSPACE_CONFIG=:4096:8"],
    ["hydra.job.name=other"],
    ["--cfg", "job"],
    ["--help"],
]


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "marker"
    monkeypatch.setenv("SCALELAB_TEST_MARKER", str(path))
    return path


@pytest.mark.parametrize("args,message", ATTACKS, ids=[" ".join(a) for a, _ in ATTACKS])
def test_every_attack_is_one_line_before_anything_runs(args: list[str], message: str, marker: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    error = check_safety([*args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert error is not None and error.startswith(message), error
    assert "\n" not in error
    assert MARKER_MODULE not in sys.modules and "antigravity" not in sys.modules  # never imported
    assert not marker.exists() and not run_dir.exists() and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("args", LEGITIMATE, ids=[" ".join(a) or "default" for a in LEGITIMATE])
def test_the_projects_own_launchers_sweepers_and_logging_pass(args: list[str], tmp_path: Path) -> None:
    assert check_safety([*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]) is None


def _refused(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"scalelab-train: error: {message}"), proc.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    ([f"+hydra.callbacks.x._target_={MARK}"], "hydra.callbacks.x._target_="),
    (["-m", "hydra/launcher=joblib", f"+hydra.launcher.x._target_={MARK}"], "hydra.launcher.x._target_="),
    (["-m", "seed=0,1", f"hydra.sweeper._target_={MARK}"], "hydra.sweeper._target_="),
    (["-m", "seed=0,1", f"strategy._target_=strategies.create,{MARK}"], "strategy._target_="),
    ([f"+hydra.job_logging.formatters.simple.class={MARK}"], "hydra.job_logging.formatters.simple.class="),
    (["+hydra.job.env_set.GIT_CONFIG_COUNT=1", "+hydra.job.env_set.GIT_CONFIG_KEY_0=core.fsmonitor"], "hydra.job.env_set.GIT_CONFIG_COUNT"),
], ids=["callback", "joblib-nested", "sweeper", "swept-app-target", "logging-class", "git-env"])
def test_scalelab_train_refuses_with_exit_code_2_and_writes_nothing(
    args: list[str], message: str, marker: Path, tmp_path: Path
) -> None:
    proc = cli(*args, *TINY["mlp"], *QUIET, *FEW, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    _refused(proc, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no marker, no run or sweep directory


def test_the_fingerprint_git_runs_no_hook_and_reads_this_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GIT_DIR``/``GIT_CONFIG_*`` in the environment (e.g. set by ``hydra.job.env_set`` before this
    was refused) neither redirect the fingerprint nor make ``git status`` run a program."""
    if not (records._REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    expected = records._git("rev-parse", "HEAD")
    marker = tmp_path / "fsmonitor-ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "not-a-repo"))
    for i, (key, value) in enumerate([("core.fsmonitor", str(hook)), ("core.hooksPath", str(tmp_path))]):
        monkeypatch.setenv(f"GIT_CONFIG_KEY_{i}", key)
        monkeypatch.setenv(f"GIT_CONFIG_VALUE_{i}", value)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "2")
    fp = records.fingerprint({}, [], "cpu")
    assert fp["git_sha"] == expected is not None
    assert isinstance(fp["git_dirty"], bool)
    assert not marker.exists()
    assert os.environ["GIT_DIR"] == str(tmp_path / "not-a-repo")  # the process's own environment is left as it was
