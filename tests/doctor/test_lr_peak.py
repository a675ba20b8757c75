"""Issue 21's "loss spike at the learning-rate peak" workload (conf/experiment/doctor_lr_spike.yaml):
a real fp16 run that skips steps as a short warmup ramps to a high rate and diverges at the peak,
which the doctor names ``lr_spike`` from the schedule's last rates; the same run at a 100x lower
peak completes."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.doctor.cases import _ce, _gpt
from experiments.schema import DIAGNOSIS_NAME
from strategies.doctor import diagnose
from tests.experiments.runs import run_tiny

RUN = ("+experiment=doctor_lr_spike", "train.eval_every=0", "train.checkpoint_every=0")


def test_a_loss_spike_at_the_lr_peak_is_named_lr_spike(tmp_path: Path) -> None:
    spiked, rows = run_tiny(tmp_path / "spike", *RUN, model="gpt")
    train = [r for r in rows if r["kind"] == "train"]
    peak = max(r["lr"] for r in train)
    assert spiked["status"] == "diverged" and train[-1]["lr"] == peak == 3.0  # it fails at the peak
    assert sum(r["skipped"] for r in train[:-1]) >= 2 and train[-2]["loss"] > 5 * train[0]["loss"]  # skips on the way up
    diag = json.loads((tmp_path / "spike" / DIAGNOSIS_NAME).read_text())
    assert diag["cause"] == "lr_spike" and "LR peak" in diag["verdict"] and diag["step"] == train[-1]["step"]
    assert "the smallest of the previous" in diag["evidence"][0] and "forward pass" in diag["evidence"][0]
    calm, _ = run_tiny(tmp_path / "calm", *RUN, "optimizer.lr=0.03", model="gpt")
    assert calm["status"] == "completed" and calm["skipped_steps"] == 0


def test_a_fast_rise_counts_only_for_a_scale_independent_overflow_at_the_peak() -> None:
    """The ramp rule: a forward overflow at the peak of a warmup is the LR's; the same overflow
    after the peak, or under a flat schedule, stays forward_overflow; two rates are never a spike."""
    model, batch = _gpt(0, 32, ffn_gain=1500.0)  # the T5-style forward overflow of the fault suite
    warmup = [0.3 * t / 9 for t in range(1, 10)]

    def cause(history: list[float]) -> str:
        return diagnose(model, _ce, batch, lr_history=history, compare_strategies=False).cause

    assert cause(warmup) == "lr_spike"
    assert cause(warmup + [0.29]) == "forward_overflow"  # past the peak (decaying)
    assert cause([0.3] * 9) == "forward_overflow" and cause(warmup[:2]) == "forward_overflow"
