"""Issue 21 (item 2): the report shows the doctor's verdict per run, read from ``diagnosis.json``
through the same bounded reader as ``summary.json``; a hostile or oversized one is a listed bad
record, never a crash."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from analysis.load import MAX_DIAGNOSIS_BYTES, load_runs
from analysis.report import main
from experiments.schema import DIAGNOSIS_NAME
from tests.analysis.synth import SweepSpec, write_sweep
from tests.experiments.runs import run_tiny

SHORT = ("train.steps=4", "train.checkpoint_every=2", "train.log_every=2", "train.eval_every=0")
GOOD = {"status": "stalled", "step": 12, "cause": "forward_overflow", "first_module": "blocks.0.fc_out",
        "verdict": "forward overflow in fp16 at blocks.0.fc_out: no loss scale can fix it",
        "fix": "keep blocks.0.fc_out in fp32", "value": float("inf"), "exit_code": 3}


def _report(root: Path, out: Path, capsys: pytest.CaptureFixture) -> tuple[str, list[dict]]:
    assert main([str(root), "--out", str(out), "--n-boot", "200"]) == 0
    capsys.readouterr()
    with (out / "runs.csv").open(encoding="utf-8") as fh:
        runs = list(csv.DictReader(fh))
    return (out / "report.md").read_text(encoding="utf-8"), runs


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_a_real_stalled_run_shows_its_verdict_in_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The training loop's own diagnosis.json (a NaN batch: the doctor says the data) reaches the
    report's Diagnoses table and runs.csv; the healthy run beside it has no diagnosis."""
    root = tmp_path / "sweep"
    stalled, _ = run_tiny(root / "nan", "regime=nan_batch", "data.nan_prob=1.0", *SHORT)
    healthy, _ = run_tiny(root / "ok", *SHORT)
    assert stalled["status"] == "stalled" and healthy["status"] == "completed"
    assert json.loads((root / "nan" / DIAGNOSIS_NAME).read_text())["cause"] == "nan_in_data_or_loss"
    md, runs = _report(root, tmp_path / "out", capsys)
    table = _section(md, "Diagnoses")
    row = next(line for line in table.splitlines() if line.startswith("| `sweep/nan` |"))
    assert "**stalled**" in row and "`nan_in_data_or_loss`" in row and "drop or repair the batch" in row
    assert "sweep/ok" not in table
    by_id = {r["run_id"]: r for r in runs}
    assert by_id["sweep/nan"]["diagnosis"] == "nan_in_data_or_loss"
    assert by_id["sweep/nan"]["diagnosis_verdict"].startswith("the batch, the weights or the loss is non-finite")
    assert by_id["sweep/ok"]["diagnosis"] == ""


def _sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    write_sweep(root, SweepSpec(true_loss={"native": 0.7, "max_ema": 0.5}, seeds=2, steps=10, extras=False))
    return root


def test_a_written_diagnosis_and_one_the_doctor_could_not_make(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = _sweep(tmp_path)
    (root / "0" / DIAGNOSIS_NAME).write_text(json.dumps(GOOD))
    (root / "1" / DIAGNOSIS_NAME).write_text(json.dumps({"status": "stalled", "step": 3,
                                                         "error": "the doctor diagnoses fp16, bf16 runs, not fp8_e4m3"}))
    md, runs = _report(root, tmp_path / "out", capsys)
    table = _section(md, "Diagnoses")
    assert "`forward_overflow`" in table and "`blocks.0.fc_out`" in table and "keep blocks.0.fc_out in fp32" in table
    assert "doctor did not run: the doctor diagnoses fp16, bf16 runs, not fp8_e4m3" in table
    assert {r["run_id"]: r["diagnosis_module"] for r in runs}["sweep/0"] == "blocks.0.fc_out"


@pytest.mark.parametrize("content, reason", [
    (b"", "unreadable diagnosis (empty)"),
    (b'{"cause": "forw', "unreadable diagnosis"),
    (b"[1, 2]", "diagnosis is a JSON list, not an object"),
    (b'{"status": "stalled", "step": 1, "cause": ["x"], "verdict": {"a": 1}, "fix": 3}',
     "wrong type for cause, fix, verdict"),
    (b'{"cause": "x", "pad": "' + b"a" * MAX_DIAGNOSIS_BYTES + b'"}', "over the 1.0 MiB read limit; not read"),
])
def test_a_bad_diagnosis_is_a_listed_bad_record(tmp_path: Path, capsys: pytest.CaptureFixture, content: bytes,
                                                reason: str) -> None:
    root = _sweep(tmp_path)
    (root / "2" / DIAGNOSIS_NAME).write_bytes(content)
    rs = load_runs(root)
    assert [p for p in rs.problems if DIAGNOSIS_NAME in p and reason in p], rs.problems
    run = rs.runs.set_index("run_id").loc["sweep/2"]
    assert reason in run["issues"] and run["status"] == "completed" and run["diagnosis"] is None
    md, _ = _report(root, tmp_path / "out", capsys)
    assert "## Diagnoses" not in md and reason in _section(md, "Run status")
    assert "`max_ema` vs `native`: clearly better than native" in md  # the good runs still compared
