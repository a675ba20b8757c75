"""The report's replay table on real app runs: ``scalelab-replay SWEEP --table`` writes ``replay.json``
into the failed or stalled runs only (skips >= 10%, at the strategy's floor), each preset's row
matching a real run of that preset on the same seed, and ``scalelab-report`` shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.load import load_runs
from analysis.replays import read_replays
from analysis.report import build_report
from experiments import schema
from experiments.replay import cli, table
from strategies.tracing import Trace
from tests.experiments.runs import run_tiny

BASE = ["train.steps=12", "train.log_every=4", "train.hist_every=4", "train.checkpoint_every=0", "train.eval_every=2"]
SPIKES = ["regime=spikes", "regime.spike_steps=[3,7]"]
PRESETS = "native,megatron,static,norm_ratio"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Four real runs of the tiny GPT on seed 0: native with two loss spikes (2 of 12 skipped:
    failed), native with its floor set where the first spike's backoff lands (at its floor), the
    same without spikes (healthy), and megatron with the spikes (the reference for its replay)."""
    root = tmp_path_factory.mktemp("table")
    run_tiny(root / "sweep" / "spikes", *BASE, *SPIKES, model="gpt")
    run_tiny(root / "sweep" / "floor", *BASE, *SPIKES, "strategy.min_scale=32768", model="gpt")
    run_tiny(root / "sweep" / "healthy", *BASE, model="gpt")
    run_tiny(root / "megatron", *BASE, *SPIKES, "strategy=megatron", model="gpt")
    return root


def _trace(run_dir: Path) -> Trace:
    return Trace.from_lines((run_dir / schema.TRACE_NAME).read_text().splitlines())


def test_failure_reasons_from_status_floor_and_skips(sweep: Path) -> None:
    spikes = _trace(sweep / "sweep" / "spikes")
    assert table.failure("completed", spikes, 1.0) == "skipped 2 of 12 steps (17%)"
    assert table.failure("completed", _trace(sweep / "sweep" / "healthy"), 1.0) is None
    assert table.failure("diverged", _trace(sweep / "sweep" / "healthy"), None) == "diverged"
    floor = _trace(sweep / "sweep" / "floor")
    at_floor = sum(row[0] <= 32768 for row in floor.scale)
    assert at_floor > 0 and table.failure("completed", floor, 32768.0).startswith(
        f"at its min scale 32768 for {at_floor} of 12 steps")


def test_table_writes_failed_runs_only_and_matches_real_runs(sweep: Path, capsys) -> None:
    (sweep / "sweep" / "healthy" / schema.REPLAY_NAME).write_text("{}")  # stale: the run is healthy
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(sweep / "sweep"), "--table", "--presets", PRESETS])
    assert exit_.value.code == 0 and "2 failed or stalled runs" in capsys.readouterr().out
    assert not (sweep / "sweep" / "healthy" / schema.REPLAY_NAME).exists()
    obj = json.loads((sweep / "sweep" / "spikes" / schema.REPLAY_NAME).read_text())
    assert set(obj) == set(schema.REPLAY_FIELDS) and obj["recorded"] == "native" and obj["skipped"] == 2
    rows = {r["strategy"]: r for r in obj["presets"]}
    assert set(rows) == set(PRESETS.split(","))
    spikes = _trace(sweep / "sweep" / "spikes")
    native = rows["native"]  # the recorded rule on its own trace: the recorded run exactly
    assert native["skipped"] == sum(spikes.found_inf) and native["final_scale"] == spikes.scale[-1][0]
    assert native["min_scale"] == min(r[0] for r in spikes.scale) and native["floor_steps"] == 0
    real = _trace(sweep / "megatron")  # megatron replayed vs megatron trained on the same seed
    assert rows["megatron"]["skipped"] == sum(real.found_inf) > native["skipped"]  # its 2^32 start overflows
    assert rows["megatron"]["final_scale"] == real.scale[-1][0]
    assert rows["megatron"]["min_scale"] == min(r[0] for r in real.scale)
    assert set(rows["norm_ratio"]) == {"strategy", "unreplayable"} and "fp32" in rows["norm_ratio"]["unreplayable"]
    assert rows["static"]["skipped"] == 2 and rows["static"]["min_scale"] == rows["static"]["final_scale"]


def test_report_shows_the_replay_table(sweep: Path, tmp_path: Path) -> None:
    if not (sweep / "sweep" / "spikes" / schema.REPLAY_NAME).exists():
        table.write_tables(sweep / "sweep", PRESETS.split(","), say=lambda _: None)
    build_report([sweep / "sweep"], tmp_path / "report", n_boot=50)
    md = (tmp_path / "report" / "report.md").read_text()
    section = md[md.index("# Replays of failed and stalled runs"):]
    assert "2 runs failed or stalled" in section and "sweep/healthy" not in section
    assert "sweep/floor" in section and "sweep/spikes" in section and "needs the fp32 probe" in section
    csv = (tmp_path / "report" / "replay.csv").read_text().splitlines()
    assert len(csv) == 1 + 2 * 4 and csv[0].startswith("run_id,status,run_why")


def test_bad_replay_files_are_problems_not_crashes(sweep: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in (schema.SUMMARY_NAME, schema.METRICS_NAME):
        (run / name).write_bytes((sweep / "sweep" / "healthy" / name).read_bytes())
    (run / schema.REPLAY_NAME).write_text(json.dumps({"why": 3, "presets": [{"strategy": "native", "skipped": "x"},
                                                                             "junk", {"skipped": 1}]}))
    rs = load_runs([run])
    problems: list[str] = []
    rows = read_replays(rs.runs, problems)
    assert len(rows) == 1 and rows.iloc[0]["strategy"] == "native" and rows.iloc[0]["skipped"] is None
    assert len(problems) == 1 and schema.REPLAY_NAME in problems[0]
    (run / schema.REPLAY_NAME).write_text("[1, 2]")
    problems.clear()
    assert read_replays(rs.runs, problems).empty and "not an object" in problems[0]


def test_a_run_opening_at_2_32_replays_as_the_real_runs_of_other_presets(tmp_path: Path) -> None:
    """areal (Megatron's scaler from 2^32, growth every 5 steps) skips its first ~16 steps halving down:
    overflows of the scale, not of the gradients. Replayed on its trace, native and verl do what their real
    runs on the same seed did (the overflow model reads the clean steps after that opening string)."""
    steps = ["train.steps=30", "train.log_every=5", "train.hist_every=0", "train.checkpoint_every=0", "train.eval_every=0"]
    for name in ("areal", "native", "verl"):
        run_tiny(tmp_path / "sweep" / name, *steps, f"strategy={name}", model="gpt")
    table.write_tables(tmp_path / "sweep", ["native", "verl"], say=lambda _: None)
    obj = json.loads((tmp_path / "sweep" / "areal" / schema.REPLAY_NAME).read_text())
    assert obj["recorded"] == "areal" and obj["skipped"] >= 16
    for row in obj["presets"]:
        real = _trace(tmp_path / "sweep" / row["strategy"])
        assert (row["skipped"], row["final_scale"]) == (sum(real.found_inf), real.scale[-1][0]) and row["skipped"] < 16
