"""``experiments.doctor.diagnosis.diagnose_run``: the loop's one call when a run fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import strategies
from experiments import schema
from experiments.doctor.diagnosis import DIAGNOSIS_NAME, annotate, diagnose_run, should_diagnose
from experiments.workloads.models import MLP
from strategies.doctor import CAUSES
from tests.experiments.runs import run_tiny
from tests.experiments.runs import DOC, documented
from strategies.state import ScaleFloorError


def loop_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def setup(nan: bool = False) -> tuple[MLP, dict]:
    torch.manual_seed(0)
    model = MLP(in_features=16, num_classes=10, width=32, depth=2)
    x = torch.randn(32, 16)
    if nan:
        x[0, 0] = float("nan")
    return model, {"x": x, "y": torch.randint(10, (32,)), "m": 1.0}


def test_a_diverged_run_gets_diagnosis_json(tmp_path: Path) -> None:
    model, batch = setup(nan=True)
    d = diagnose_run(tmp_path, model, loop_loss, batch, "fp16", strategies.create("native"), lambda s: 1e-3, 7, "diverged")
    assert d is not None and d.cause == "nan_in_data_or_loss"
    data = json.loads((tmp_path / DIAGNOSIS_NAME).read_text())
    assert data["status"] == "diverged" and data["step"] == 7 and data["cause"] == "nan_in_data_or_loss"
    assert data["exit_code"] == 4


def test_the_loss_multiplier_is_what_the_doctor_differentiates(tmp_path: Path) -> None:
    model, batch = setup()
    batch["m"] = 100.0  # the regime's multiplier: overflows the backward at 2^16
    d = diagnose_run(tmp_path, model, loop_loss, batch, "fp16", strategies.create("native"), lambda s: 1e-3, 3, "stalled")
    assert d is not None and d.cause == "scale_overflow" and d.scale == 2.0**16


def test_completed_runs_and_empty_batches_are_left_alone(tmp_path: Path) -> None:
    model, batch = setup(nan=True)
    scaler = strategies.create("native")
    assert diagnose_run(tmp_path, model, loop_loss, batch, "fp16", scaler, lambda s: 1e-3, 5, "completed") is None
    assert diagnose_run(tmp_path, model, loop_loss, {}, "fp16", scaler, lambda s: 1e-3, 0, "diverged") is None
    assert not (tmp_path / DIAGNOSIS_NAME).exists()


def test_the_scale_floor_error_triggers_it() -> None:
    assert should_diagnose("failed", ScaleFloorError("x")) and should_diagnose("failed", "ScaleFloorError: at step 3")
    assert not should_diagnose("failed", "RuntimeError: boom") and not should_diagnose("failed", ValueError("x"))


@pytest.mark.parametrize("precision,loss,message", [
    ("fp8_e4m3", loop_loss, "the doctor diagnoses fp16, bf16 runs, not fp8_e4m3"),
    ("fp16", lambda logits, y: (_ for _ in ()).throw(RuntimeError("boom")), "RuntimeError: boom"),
])
def test_a_doctor_that_cannot_run_writes_why_and_never_raises(tmp_path: Path, precision: str, loss, message: str) -> None:
    model, batch = setup()
    assert diagnose_run(tmp_path, model, loss, batch, precision, strategies.create("native"), lambda s: 1e-3, 2, "stalled") is None
    assert json.loads((tmp_path / DIAGNOSIS_NAME).read_text())["error"] == message


def test_a_strategy_stopped_at_its_floor_is_diagnosed_at_that_floor(tmp_path: Path) -> None:
    model, batch = setup()
    batch["m"] = 1e8  # overflows fp16 even at S = 1
    scaler = strategies.create("native", init_scale=1.0, min_scale=1.0, on_min_scale="raise")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loop_loss(model(batch["x"]), batch["y"]) * batch["m"]
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()  # the overflow at the floor: recorded, raised at the next host read
    with pytest.raises(ScaleFloorError):
        scaler.get_scale()
    # The floor error leaves the failing step's own (non-finite) gradients in .grad, as in the
    # loop: they are set aside, not taken for accumulated ones, and put back afterwards.
    held = [p.grad for p in model.parameters()]
    assert any(not torch.isfinite(g).all() for g in held)
    d = diagnose_run(tmp_path, model, loop_loss, batch, "fp16", scaler, lambda s: 1e-3, 1,
                     "failed", "ScaleFloorError: native: step 1: ...")
    assert d is not None and d.scale == 1.0 and d.cause == "gradient_overflow" and d.first_module == "head"
    assert all(p.grad is g for p, g in zip(model.parameters(), held))


def test_annotate_appends_the_verdict_to_the_stop_message(tmp_path: Path) -> None:
    """The loop's stop message gains the doctor's one line; runs it did not diagnose keep theirs."""
    model, batch = setup(nan=True)
    d = diagnose_run(tmp_path, model, loop_loss, batch, "fp16", strategies.create("native"), lambda s: 1e-3, 4, "stalled",
                     "skipped 3 steps in a row")
    assert d is not None
    line = annotate("stalled", "skipped 3 steps in a row", d)
    assert line == f"skipped 3 steps in a row; {d.one_line()}" and "\n" not in line
    assert line.split("; doctor: ", 1)[1].startswith("nan_in_data_or_loss")
    assert annotate("diverged", None, d) == d.one_line()
    assert annotate("failed", "ScaleFloorError: native: step 4", d).endswith(d.one_line())
    assert annotate("completed", None, d) is None  # not a run the doctor diagnoses
    assert annotate("failed", "RuntimeError: boom", d) == "RuntimeError: boom"
    assert annotate("stalled", "skipped 3 steps in a row", None) == "skipped 3 steps in a row"


def test_diagnosis_json_follows_the_schema(tmp_path: Path) -> None:
    model, batch = setup(nan=True)
    diagnose_run(tmp_path, model, loop_loss, batch, "fp16", strategies.create("native"), lambda s: 1e-3, 4, "stalled")
    data = json.loads((tmp_path / schema.DIAGNOSIS_NAME).read_text())
    assert set(data) <= set(schema.DIAGNOSIS_FIELDS) and data["cause"] in CAUSES
    assert all(schema.coerce(schema.DIAGNOSIS_FIELDS[k], v) is not None for k, v in data.items() if v is not None)


def test_run_records_doc_lists_the_diagnosis_fields() -> None:
    assert documented("## `diagnosis.json`", "## `replay.json`") == set(schema.DIAGNOSIS_FIELDS)
    assert f"`{schema.DIAGNOSIS_NAME}`" in DOC.read_text()


def test_a_stalled_runs_stop_message_ends_with_the_verdict(tmp_path: Path) -> None:
    summary, _ = run_tiny(tmp_path / "run", "model=gpt_ffn_overflow", "model.ffn_gain=3000", "train.steps=4",
                          "train.checkpoint_every=2", "train.log_every=2", "train.eval_every=0", model="gpt")
    assert summary["status"] == "stalled" and summary["diagnosis"] == "forward_overflow"
    assert summary["error"].startswith("forward overflow: ")
    assert summary["error"].endswith("; doctor: forward_overflow at blocks.0.fc_out: forward overflow in fp16 at "
                                     "blocks.0.fc_out: no loss scale can fix it; fix: keep blocks.0.fc_out in fp32 "
                                     "(run its forward under torch.autocast(..., enabled=False) on a .float() input, "
                                     "as HF keeps T5's `wo` via _keep_in_fp32_modules), or train in bf16")
    assert json.loads((tmp_path / "run" / schema.SUMMARY_NAME).read_text())["diagnosis"] == "forward_overflow"
