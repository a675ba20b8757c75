"""``make replay-check``'s per-pair numbers (``experiments.replay.check.agreement``) on trajectories
whose answers are read off by hand: the first skip difference, the share within 2x before and after
it, and how long the prediction stays within 2x past it."""

from __future__ import annotations

import json

from experiments.replay.check import agreement, court_pairs
from experiments.replay.runs import finished
from strategies.tracing import FORMATS, Trace
from strategies.tracing.replay import ReplayResult, ReplayStep


def real_run(scales: list[float], skipped: list[bool]) -> Trace:
    t = Trace(["a"], [1], format=FORMATS["fp16"])
    for i, (s, k) in enumerate(zip(scales, skipped), 1):
        t.add_row(i, [float(k), 1.0, 1.0, 1.0, 0.0, 0.0, 0.1, s, 1.0])
    return t


def replayed(scales: list[float], skipped: list[bool]) -> ReplayResult:
    r = ReplayResult("x")
    r.steps = [ReplayStep(i, s, k) for i, (s, k) in enumerate(zip(scales, skipped), 1)]
    return r


def test_agreement_up_to_and_past_the_first_skip_difference() -> None:
    real = real_run([8, 8, 8, 4, 4, 4, 4], [False, False, True, False, False, False, False])
    # step 2 is 3x off (outside 2x); the skip decisions first differ at step 4; steps 4-5 stay within 2x
    pred = replayed([8, 24, 8, 4, 8, 1, 4], [False, False, True, True, False, False, False])
    a = agreement(pred, real)
    assert a["first_diff"] == 4 and a["steps"] == 7
    assert a["within_before"] == 2 / 3 and a["within_after"] == 3 / 4
    assert a["useful_after"] == 2  # steps 4 and 5; step 6 is 4x off
    assert (a["skipped_replay"], a["skipped_real"]) == (2, 1)


def test_a_replay_that_never_differs() -> None:
    real = real_run([8, 16, 16], [False, False, False])
    a = agreement(replayed([8, 16, 32], [False, False, False]), real)
    assert a["first_diff"] is None and a["within_before"] == 1.0
    assert a["within_after"] is None and a["useful_after"] is None


def test_a_finished_run_is_reused_only_for_its_own_overrides(tmp_path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "fingerprint": {"overrides": ["seed=0"]}}))
    assert finished(tmp_path, ["seed=0"])["status"] == "completed"
    assert finished(tmp_path, ["seed=1"]) is None  # an earlier check's run of another config: trained again
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running", "fingerprint": {"overrides": ["seed=0"]}}))
    assert finished(tmp_path, ["seed=0"]) is None


def test_a_replayed_scale_of_zero_is_never_within_2x() -> None:
    real = real_run([8, 8, 8], [False, True, True])
    a = agreement(replayed([8, 0.0, 0.0], [False, True, True]), real)  # persist can halve a scale to 0
    assert a["first_diff"] is None and a["within_after"] is None and a["within_before"] == 1 / 3


def test_court_pairs_read_every_preset_cell(tmp_path) -> None:
    """Two court cells on both workloads: each replayed on the other's and its own trace; a preset on
    its own trace (a run of 2^16 whose step 3 overflowed) is that run under every overflow model."""
    scales, skipped = [65536.0, 65536.0, 65536.0, 32768.0, 32768.0], [False, False, True, False, False]
    for w in ("rl", "finetune"):
        for cell in ("native", "verl", "none"):
            d = tmp_path / w / f"fp16-{cell}" / "seed0"
            d.mkdir(parents=True)
            t = real_run(scales, skipped)
            t.meta = {"strategy": cell}
            (d / "trace.jsonl").write_text("\n".join(t.lines()) + "\n")
    rows = court_pairs(tmp_path, (0,))
    assert len(rows) == 2 * 4 and {(r["source"], r["target"]) for r in rows} == {
        ("native", "native"), ("native", "verl"), ("verl", "native"), ("verl", "verl")}  # none is no preset
    own = [r for r in rows if r["source"] == r["target"] == "native"]
    assert all(r[m]["first_diff"] is None and r[m]["within_before"] == 1.0 for r in own for m in ("auto", "persist", "bound"))
