"""The trace in the app's run records and ``scalelab-replay`` on them: every run writes
``trace.jsonl`` (training unchanged), a resume cuts it back to the checkpoint's step, and the CLI
replays any rule or preset through the YAML, with one-line errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from experiments import schema
from experiments.app.tracefile import TraceFile
from experiments.replay import cli
from experiments.workloads.precision import Precision
from strategies.tracing import Trace, replay
from strategies.watch.detector import Detector, observations
from tests.experiments.runs import read_rows, run_tiny

SPIKES = ["regime=spikes", "regime.spike_steps=[3,7]", "train.steps=12", "train.log_every=4", "train.hist_every=4",
          "train.checkpoint_every=0", "train.eval_every=0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replay") / "run"
    run_tiny(out, *SPIKES, model="gpt")
    return out


def _untimed(rows: list[dict]) -> list[dict]:
    def strip(x):
        return {k: strip(v) for k, v in x.items() if not re.search(r"time|_s$", k)} if isinstance(x, dict) else x
    return [strip(r) for r in rows]


def test_every_run_writes_its_trace_and_training_is_unchanged(run_dir: Path, tmp_path: Path) -> None:
    trace = cli.load_trace(run_dir)
    assert trace.steps == list(range(1, 13)) and trace.found_inf == [s in (3, 7) for s in range(1, 13)]
    assert sorted(trace.histograms) == [4, 8, 12] and trace.meta["strategy"] == "native"
    rows = read_rows(run_dir)
    logged = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert all(trace.scale[s][0] * (0.5 if s + 1 in (3, 7) else 1) == logged[s + 1]["scale"] for s in (3, 7, 11))
    assert logged[4]["act_exp_hist"]["counts"] == trace.histograms[4].counts
    run_tiny(tmp_path / "off", *SPIKES, "train.trace=false", model="gpt")
    assert not (tmp_path / "off" / schema.TRACE_NAME).exists()
    assert _untimed(read_rows(tmp_path / "off")) == _untimed(rows)


def test_a_resume_cuts_the_trace_back_to_the_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / schema.TRACE_NAME
    path.write_text((run_dir / schema.TRACE_NAME).read_text() + '{"kind": "trace", "step": 13, "n"')  # torn
    prec = Precision("fp16", None, None, 65504.0, 2.0**-14)
    f = TraceFile(path, None, None, prec, {})
    f.open(start_step=6)
    f.close()
    assert Trace.from_lines(path.read_text().splitlines()).steps == [1, 2, 3, 4, 5, 6]


def _main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(args))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_replay_text_json_and_all(run_dir: Path, capsys) -> None:
    code, out, _ = _main(capsys, str(run_dir), "--strategy", "native")
    assert code == 0 and "native: skips 2 of 12 steps: 3, 7" in out and "recorded: native, fp16" in out
    det = Detector()
    det.run(observations(cli.load_trace(run_dir)))  # the recorded run through the fitted detector
    want = "early warning: none in 12 steps" if det.alarm_step is None else f"early warning: step {det.alarm_step} of 12: "
    assert out.splitlines()[1].startswith(want)
    code, out, _ = _main(capsys, str(run_dir), "--strategy", "megatron", "--set", "init_scale=1024", "--json")
    steps = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [s["step"] for s in steps] == list(range(1, 13)) and steps[0]["scale"] == 1024.0
    assert set(steps[3]) == {"step", "scale", "skipped", "lost_frac", "subnormal_frac"}
    code, out, _ = _main(capsys, str(run_dir), "--strategy", "layerwise", "--json")
    assert len(json.loads(out.splitlines()[0])["scales"]) == 4  # embed, blocks.0, ln_f, head
    code, out, _ = _main(capsys, str(run_dir), "--strategy", "all")
    assert code == 0 and "norm_ratio: not replayed: norm_ratio compares" in out and "\nte_delayed: skips" in out


@pytest.mark.parametrize("args,code,message", [
    (["--strategy", "nope"], 2, "unknown strategy 'nope'; available: amax_history"),
    (["--strategy", "native", "--set", "foo=1"], 2, "native has no option 'foo'; its options: "),
    (["--strategy", "native", "--set", "growth_factor=0.5"], 2, "growth_factor must be > 1, got 0.5"),
    (["--strategy", "native", "--set", "oops"], 2, "bad --set 'oops'"),
    (["--strategy", "norm_ratio"], 3, "cannot replay: norm_ratio compares each probe step"),
])
def test_errors_are_one_line(run_dir: Path, capsys, args: list[str], code: int, message: str) -> None:
    got, _, err = _main(capsys, str(run_dir), *args)
    assert got == code and message in err and len(err.strip().splitlines()) == 1


def test_a_missing_or_corrupt_trace_is_one_line(run_dir: Path, tmp_path: Path, capsys) -> None:
    code, _, err = _main(capsys, str(tmp_path / "none"), "--strategy", "native")
    assert code == 2 and "does not exist" in err
    code, _, err = _main(capsys, str(tmp_path), "--strategy", "native")
    assert code == 2 and f"has no {schema.TRACE_NAME}" in err
    lines = (run_dir / schema.TRACE_NAME).read_text().splitlines()
    (tmp_path / schema.TRACE_NAME).write_text("\n".join([lines[0], lines[1][:-30] + '"}', *lines[2:]]) + "\n")
    code, _, err = _main(capsys, str(tmp_path), "--strategy", "native")
    assert code == 2 and "corrupt trace: line 2" in err and len(err.strip().splitlines()) == 1


def test_an_rl_run_is_traced_and_replays_as_itself(tmp_path: Path) -> None:
    """The GRPO workload's step (``rl_step``) leaves its trace rows too: each step's loss is the one
    logged, and its own rule replayed on it skips where it skipped and retraces its scales."""
    summary, rows = run_tiny(tmp_path, "train.steps=6", "train.log_every=1", "precision=fp16", "strategy=native",
                             model="rl")
    trace = cli.load_trace(tmp_path)
    logged = [r for r in rows if r["kind"] == "train"]
    assert trace.steps == list(range(1, 7)) and [r["loss"] for r in logged] == pytest.approx(trace.loss, rel=1e-6)
    replayed = replay(trace, "native")
    assert [s.scale for s in replayed.steps] == [row[0] for row in trace.scale]
    assert replayed.skipped_steps == [s for s, f in zip(trace.steps, trace.found_inf) if f]


def test_the_early_warning_line_on_a_collapsing_run(tmp_path: Path, capsys) -> None:
    """A trace that overflows at every step from step 5 on (the scale halving each time) gets the
    fitted detector's warning, at the step the detector itself names."""
    t = Trace(["a"], [10])
    scale = 65536.0
    for step in range(1, 41):
        bad = step >= 5
        t.add_row(step, [float(bad), 2.0, math.nan if bad else 1e-3, 1.0, 0.0, 0.0, 0.1, scale, math.inf if bad else 1e-3])
        scale = scale / 2 if bad else scale
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in t.lines()))
    det = Detector()
    det.run(observations(t))
    assert det.alarm_step is not None and det.alarm_step > 5
    code, out, _ = _main(capsys, str(path), "--strategy", "native")
    assert code == 0 and out.splitlines()[1].startswith(f"early warning: step {det.alarm_step} of 40: ")
