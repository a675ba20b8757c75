"""``scalelab-doctor RUN_DIR`` on run directories written by the real training loop, and its
one-line errors for directories it cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import schema
from experiments.doctor.cli import main
from tests.experiments.runs import REPO, run_tiny

SHORT = ("train.steps=4", "train.checkpoint_every=2", "train.log_every=2", "train.eval_every=0")


def test_nan_batch_run_is_diagnosed_as_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary, _ = run_tiny(tmp_path / "run", "regime=nan_batch", "data.nan_prob=1.0", *SHORT)
    assert summary["status"] == "stalled" and summary["error"].startswith("non-finite inputs:")
    assert main([str(tmp_path / "run"), "--no-strategies"]) == 4
    out = capsys.readouterr().out
    assert "verdict: NAN_IN_DATA_OR_LOSS" in out and "NaN/Inf entries" in out


def test_ffn_overflow_run_names_the_module_in_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_tiny(tmp_path / "run", "model=gpt_ffn_overflow", "model.ffn_gain=3000", *SHORT, model="gpt")
    assert main([str(tmp_path / "run"), "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["cause"] == "forward_overflow" and data["first_module"] == "blocks.0.fc_out"
    assert data["value"] > 65504 and data["exit_code"] == 3 and data["step"] == 2


def test_healthy_run_exits_zero_with_the_strategies_scales(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_tiny(tmp_path / "run", *SHORT)
    code = main([str(tmp_path / "run"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == data["exit_code"] == 0 and data["cause"] == "healthy"
    assert data["scale"] == 65536.0 and data["strategy_scales"]["native"] == 65536.0
    assert data["status"] == "completed" and data["step"] == 4


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("scalelab-doctor: error: ")
    return err


def test_unusable_directories_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert "does not exist" in _error([str(tmp_path / "nope")], capsys)
    assert "not a scalelab run directory" in _error([str(tmp_path)], capsys)
    (tmp_path / schema.SUMMARY_NAME).write_text("{}")
    assert "without a checkpoint" in _error([str(tmp_path)], capsys)
    (tmp_path / schema.CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    assert "unreadable (truncated or corrupt" in _error([str(tmp_path)], capsys)


def test_precision_the_doctor_does_not_cover(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_tiny(tmp_path / "run", "precision=fp32", "strategy=none", *SHORT)
    assert "precision 'fp32'; the doctor diagnoses fp16, bf16 runs" in _error([str(tmp_path / "run")], capsys)


def test_console_module_runs(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "experiments.doctor.cli", str(tmp_path / "nope")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("scalelab-doctor: error: run directory")


LOGITS = ("model=gpt_logit_growth", "optimizer.lr=0.3", "optimizer.weight_decay=0", "train.grad_clip=0", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
          "data.block_size=32", "data.max_bytes=200000", "train.batch_size=16", "train.steps=200",
          "train.log_every=10", "train.checkpoint_every=10", "train.eval_every=0", "train.max_consecutive_skips=10")


@pytest.mark.slow
def test_attention_logit_growth_really_happens_and_qk_norm_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Wortsman et al. 2023 at small scale: the fp16 logits overflow at a high LR; QK-norm trains."""
    grown, _ = run_tiny(tmp_path / "grown", *LOGITS, model="gpt")
    assert grown["status"] in ("diverged", "stalled")
    assert main([str(tmp_path / "grown"), "--json", "--no-strategies"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["first_module"] == "blocks.0.scores" and "QK-norm" in data["fix"]
    fixed, _ = run_tiny(tmp_path / "fixed", *LOGITS, "model.qk_norm=true", model="gpt")
    assert fixed["status"] == "completed"
