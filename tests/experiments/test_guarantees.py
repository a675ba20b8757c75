"""What a run directory promises and what the app refuses (issue 13, app side; docs/guarantees.md):
resume only the same run, a malformed metrics line never blocks resume, one writer per directory,
a collapsed scale stops the run as ``stalled``, and bad values are one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from experiments.app import checkpoint, records

from experiments import schema
from experiments.app.build import AppError, ConfigError
from experiments.app.rundir import RunDir, config_diff
from tests.experiments.runs import QUIET, TINY, cli, compose_cfg, read_rows, run_tiny

SHORT = ["train.steps=10", "train.log_every=5", "train.checkpoint_every=5", "train.eval_every=0"]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in (schema.SUMMARY_NAME, schema.METRICS_NAME, schema.CHECKPOINT_NAME)}


# ----------------------------------------------------------------------------- case 1
def test_a_different_config_is_refused_naming_the_keys_and_nothing_changes(tmp_path: Path) -> None:
    run_tiny(tmp_path, *SHORT, "seed=0")
    before = _files(tmp_path)
    with pytest.raises(ConfigError) as err:
        run_tiny(tmp_path, *SHORT, "seed=1", "strategy.init_scale=1024")
    message = str(err.value)
    assert "\n" not in message and "holds another run" in message
    assert "seed (0 -> 1)" in message and "strategy.init_scale (65536.0 -> 1024)" in message
    assert "train.resume=false" in message
    assert _files(tmp_path) == before


def test_a_killed_run_of_another_seed_is_not_resumed(tmp_path: Path) -> None:
    """The issue's case: a killed seed=0 run, then seed=1 in the same directory."""
    killed = cli(*TINY["mlp"], *QUIET, *SHORT, "seed=0", "train.kill_at_step=7", f"hydra.run.dir={tmp_path}")
    assert killed.returncode != 0
    assert json.loads((tmp_path / schema.SUMMARY_NAME).read_text())["status"] == "running"
    result = cli(*TINY["mlp"], *QUIET, *SHORT, "seed=1", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "seed (0 -> 1)" in lines[0], result.stderr
    assert torch.load(tmp_path / schema.CHECKPOINT_NAME, weights_only=True)["config"]["seed"] == 0
    assert "seed: 0" in (tmp_path / ".hydra" / "config.yaml").read_text()  # refused before Hydra rewrote it


def test_resume_false_starts_over_and_moves_the_earlier_records_aside(tmp_path: Path) -> None:
    run_tiny(tmp_path, *SHORT, "seed=0")
    before = _files(tmp_path)
    summary, rows = run_tiny(tmp_path, *SHORT, "seed=1", "train.resume=false")
    assert summary["seed"] == 1 and summary["status"] == "completed"
    assert [r["step"] for r in rows if r["kind"] == "train"] == [5, 10]
    kept = tmp_path / f"{schema.REPLACED_PREFIX}1"
    assert {name: (kept / (name + schema.REPLACED_SUFFIX)).read_bytes() for name in before} == before
    # A third start over keeps both earlier runs.
    run_tiny(tmp_path, *SHORT, "seed=2", "train.resume=false")
    assert (tmp_path / f"{schema.REPLACED_PREFIX}2" / (schema.SUMMARY_NAME + schema.REPLACED_SUFFIX)).exists()
    assert json.loads((kept / (schema.SUMMARY_NAME + schema.REPLACED_SUFFIX)).read_text())["seed"] == 0


def test_keys_that_do_not_change_the_run_may_change_on_resume(tmp_path: Path) -> None:
    run_tiny(tmp_path, *SHORT)
    longer, rows = run_tiny(tmp_path, *SHORT[1:], "train.steps=15", "threads=2", "train.progress=false")
    assert longer["steps"] == 15 and [r["step"] for r in rows if r["kind"] == "train"] == [5, 10, 15]
    assert config_diff({"train": {"steps": 1}, "logger": {"x": 1}}, {"train": {"steps": 2}, "logger": {}}) == ""


def test_a_finished_run_without_checkpoint_is_left_alone(tmp_path: Path) -> None:
    first, _ = run_tiny(tmp_path, "train.steps=6", "train.log_every=3", "train.checkpoint_every=0")
    assert not (tmp_path / schema.CHECKPOINT_NAME).exists()
    before = {name: (tmp_path / name).read_bytes() for name in (schema.SUMMARY_NAME, schema.METRICS_NAME)}
    again, _ = run_tiny(tmp_path, "train.steps=6", "train.log_every=3", "train.checkpoint_every=0")
    assert again == json.loads(json.dumps(first))
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_a_record_without_a_configuration_is_not_resumed(tmp_path: Path) -> None:
    (tmp_path / schema.METRICS_NAME).write_text('{"kind": "train", "step": 5}\n')
    with pytest.raises(AppError, match="holds a record without a readable configuration; .*train.resume=false"):
        run_tiny(tmp_path, *SHORT)
    assert (tmp_path / schema.METRICS_NAME).read_text() == '{"kind": "train", "step": 5}\n'


def _config(*overrides: str) -> dict:
    """The resolved config a run of these overrides records (as ``loop.run`` resolves it)."""
    config = OmegaConf.to_container(compose_cfg(*TINY["mlp"], *QUIET, *overrides), resolve=True)
    assert isinstance(config, dict)
    return config


def test_what_a_run_does_with_its_directory_is_one_decision(tmp_path: Path) -> None:
    """``RunDir.resume_plan``: start, resume, finished or refuse, as one value; deciding writes nothing."""
    here = RunDir(tmp_path)
    assert here.resume_plan(_config(*SHORT), True, 10) == here.resume_plan(_config(*SHORT), True, 10)
    assert here.resume_plan(_config(*SHORT), True, 10).action == "start"
    first, _ = run_tiny(tmp_path, *SHORT)
    before = _files(tmp_path)
    done = here.resume_plan(_config(*SHORT), True, 10)
    assert (done.action, done.status, done.step, done.summary) == ("finished", "completed", 10, json.loads(json.dumps(first)))
    longer = here.resume_plan(_config(*SHORT[1:], "train.steps=15"), True, 15)
    assert longer.action == "resume" and longer.step == 10 and longer.state is not None and longer.state["step"] == 10
    other = here.resume_plan(_config(*SHORT, "seed=1"), True, 10)
    assert other.action == "refuse" and isinstance(other.refusal, ConfigError) and "seed (0 -> 1)" in str(other.refusal)
    with pytest.raises(ConfigError, match="holds another run"):
        other.check()
    over = here.resume_plan(_config(*SHORT, "seed=1"), False, 10)
    assert (over.action, over.replaces, over.state) == ("start", "train.resume=false", None)
    assert _files(tmp_path) == before
    (tmp_path / schema.CHECKPOINT_NAME).unlink()
    gone = here.resume_plan(_config(*SHORT[1:], "train.steps=15"), True, 15)
    assert (gone.action, gone.replaces) == ("start", "no checkpoint to resume from")


# ----------------------------------------------------------------------------- case 2
@pytest.mark.parametrize(
    "bad",
    ['{"kind": "train", "step": "seven"}', '{"kind": "train", "step": 3.5}', "[1, 2]", "not json at all",
     '{"kind": "train"}', '{"kind": {"x": 1}, "step": 1}', '{"kind": "train", "step": null}'],
)
def test_a_malformed_metrics_line_never_blocks_resume(tmp_path: Path, bad: str, capfd) -> None:
    args = ["train.log_every=5", "train.checkpoint_every=10", "train.eval_every=0"]
    run_tiny(tmp_path, *args, "train.steps=10")
    path = tmp_path / schema.METRICS_NAME
    valid = read_rows(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + [bad] + lines[1:]) + "\n")
    capfd.readouterr()
    summary, rows = run_tiny(tmp_path, *args, "train.steps=15")
    err = capfd.readouterr().err.strip().splitlines()
    assert summary["status"] == "completed" and summary["steps"] == 15
    assert rows[: len(valid)] == valid  # every valid line kept, byte for byte
    assert [(r["kind"], r["step"]) for r in rows[len(valid):]] == [("train", 15), ("eval", 15)]
    assert err == ["scalelab-train: resuming {} at step 10: dropped 0 line(s) of metrics.jsonl after that step "
                   "and 1 malformed line(s)".format(tmp_path)]


# ----------------------------------------------------------------------------- case 3
def test_a_second_writer_fails_at_once_and_overwrites_nothing(tmp_path: Path) -> None:
    run_tiny(tmp_path, *SHORT)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("the first run's\n")
    before = {**_files(tmp_path), ".hydra/config.yaml": (tmp_path / ".hydra" / "config.yaml").read_bytes()}
    holder = RunDir(tmp_path)
    holder.lock()  # the first process, still running
    try:
        result = cli(*TINY["mlp"], *QUIET, *SHORT, "train.steps=20", f"hydra.run.dir={tmp_path}")
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"run directory {tmp_path} is in use by another process (pid {os.getpid()})" in lines[0]
        with pytest.raises(AppError, match="is in use by another process"):  # same process, second run
            run_tiny(tmp_path, *SHORT, "train.steps=20")
        assert {**_files(tmp_path), ".hydra/config.yaml": (tmp_path / ".hydra" / "config.yaml").read_bytes()} == before
    finally:
        holder.release()
    # Released on exit (here: the end of the run): the directory is usable again, and unlocked.
    summary, _ = run_tiny(tmp_path, *SHORT[1:], "train.steps=15")
    assert summary["steps"] == 15
    with open(tmp_path / schema.LOCK_NAME) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_lock_is_released_when_the_run_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import experiments.app.loop as loop

    monkeypatch.setattr(loop, "_evaluate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_tiny(tmp_path, "train.steps=4", "train.log_every=2", "train.eval_every=2")
    with open(tmp_path / schema.LOCK_NAME) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ----------------------------------------------------------------------------- case 7
def test_a_collapsed_scale_stops_the_run_as_stalled(tmp_path: Path) -> None:
    """Every step overflows (a x1e30 loss multiplier in fp16, static scale: no recovery)."""
    spikes = "[" + ",".join(str(s) for s in range(1, 31)) + "]"
    summary, rows = run_tiny(tmp_path, "precision=fp16", "strategy=native", "regime=spikes", f"regime.spike_steps={spikes}",
                             "regime.spike_factor=1e12", "train.steps=30", "train.log_every=5",
                             "train.max_consecutive_skips=8")
    assert "stalled" in schema.STATUSES
    assert summary["status"] == "stalled" and summary["steps"] == 8 and summary["skipped_steps"] == 8
    assert "skipped 8 steps in a row" in summary["error"] and "collapsed" in summary["error"]
    assert "\n" not in summary["error"] and summary["diverged"] is False
    again, _ = run_tiny(tmp_path, "precision=fp16", "strategy=native", "regime=spikes", f"regime.spike_steps={spikes}",
                        "regime.spike_factor=1e12", "train.steps=30", "train.log_every=5",
                        "train.max_consecutive_skips=8")
    assert again == json.loads(json.dumps(summary))  # a stalled run is finished: left alone


def test_max_consecutive_skips_zero_is_off(tmp_path: Path) -> None:
    spikes = "[" + ",".join(str(s) for s in range(1, 13)) + "]"
    summary, _ = run_tiny(tmp_path, "precision=fp16", "strategy=native", "regime=spikes", f"regime.spike_steps={spikes}",
                          "regime.spike_factor=1e12", "train.steps=12", "train.log_every=4",
                          "train.max_consecutive_skips=0")
    assert summary["status"] == "completed" and summary["skipped_steps"] == 12


# ----------------------------------------------------------------------------- case 8
@pytest.mark.parametrize(
    "override,needle",
    [
        ("optimizer.lr=nan", "optimizer.lr must be a finite number in [0, 3.4e+38] (float32), got nan"),
        ("optimizer.lr=inf", "optimizer.lr must be a finite number in [0, 3.4e+38] (float32), got inf"),
        ("optimizer.lr=-0.1", "optimizer.lr must be a finite number in [0, 3.4e+38] (float32), got -0.1"),
        ("optimizer.lr=1e300", "optimizer.lr must be a finite number in [0, 3.4e+38] (float32), got 1e+300"),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay must be a finite number in [0, 3.4e+38] (float32), got -1"),
        ("optimizer.betas=[0.9,nan]", "optimizer.betas must be a finite number in [0, 3.4e+38] (float32), got [0.9, nan]"),
        ("optimizer.lr={a:1}", "optimizer.lr must be a number or a list of numbers"),
        ("train.steps=100000000000", "train.steps must be an integer below 2^31"),
        # The strategy's own words (its ValueError at attach or first use) after "strategy: ".
        ("strategy=layerwise", "'nothing.*' match"),
        ("strategy=norm_ratio", "'nothing.*'] match"),
    ],
)
def test_bad_values_are_one_line_config_errors(tmp_path: Path, override: str, needle: str) -> None:
    extra = {"strategy=layerwise": "strategy.groups=[nothing.*]", "strategy=norm_ratio": "strategy.probe_layers=[nothing.*]"}
    overrides = [override] + ([extra[override]] if override in extra else [])
    with pytest.raises(ConfigError) as err:
        run_tiny(tmp_path, "train.steps=4", *overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)
    if override.startswith("strategy="):
        assert str(err.value).startswith("strategy: ") and "no " in str(err.value)


def test_an_output_directory_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("mine")
    for where in (target, target / "below"):
        result = cli(*TINY["mlp"], *QUIET, "train.steps=2", f"hydra.run.dir={where}")
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("scalelab-train: error: output directory") and str(where) in lines[0]
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        run_tiny(target, "train.steps=2")
    assert target.read_text() == "mine"


def test_an_unwritable_output_directory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As root, permission bits do not stop writes, so unwritability is simulated at os.access.
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path / "ro" else real(p, mode, **kw))
    (tmp_path / "ro").mkdir()
    with pytest.raises(ConfigError, match=f"^output directory {tmp_path / 'ro'} is not writable"):
        run_tiny(tmp_path / "ro", "train.steps=2")
    assert list((tmp_path / "ro").iterdir()) == []


class _Killed(BaseException):
    """Stands for a kill in the middle of a write."""


def test_a_write_killed_half_way_leaves_the_old_summary_and_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Atomic records: a write torn at any point leaves the previous file whole (temporary file + rename)."""
    summary, ckpt = tmp_path / schema.SUMMARY_NAME, tmp_path / schema.CHECKPOINT_NAME
    records.write_json_atomic(summary, {"status": "running"})
    checkpoint.save(ckpt, {"step": 1})
    before = summary.read_bytes(), ckpt.read_bytes()

    def torn_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise _Killed

    def torn_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"PK\x03\x04 half a zip")  # type: ignore[attr-defined]
        raise _Killed

    monkeypatch.setattr(Path, "write_text", torn_text)
    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(_Killed):
        records.write_json_atomic(summary, {"status": "completed", "pad": "x" * 1000})
    with pytest.raises(_Killed):
        checkpoint.save(ckpt, {"step": 2})
    monkeypatch.undo()
    assert (summary.read_bytes(), ckpt.read_bytes()) == before
    assert checkpoint.load(ckpt)["step"] == 1


def test_every_guarantee_names_tests_that_exist() -> None:
    """docs/guarantees.md: every row of its tables names at least one test, and each named test exists."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "guarantees.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith(("| guarantee", "| what", "| trusted"))]
    node = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
    for row in rows:
        if "**" in row or row.count("|") == 6:  # a promise, or a refusal (4 columns)
            assert node.search(row), f"no test named for: {row[:80]}"
    for path, name in node.findall(doc):
        assert re.search(rf"^def {name}\(", (root / path).read_text(), re.M), f"{path}::{name} does not exist"
