"""The training loop, in-process on tiny configs: run records as ``docs/run-records.md`` says,
the underflow evidence, divergence and failure handling, resume, every strategy and precision."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

import experiments.app.loop as loop
import strategies
from experiments.app.recipe import lr_at
from experiments.app.train import group_options
from strategies.base import Strategy
from tests.experiments.runs import run_tiny

TRAIN_KEYS = {
    "kind", "step", "loss", "scale", "skipped", "skipped_total", "grad_absmax", "grad_norm",
    "grad_zero_frac", "grad_subnormal_frac", "act_zero_frac", "act_subnormal_frac", "lr",
    "step_time_s", "strategy_time_s",
}
SUMMARY_KEYS = {
    "status", "error", "strategy", "precision", "model", "data", "regime", "workload", "seed", "sweep",
    "steps", "final_train_loss", "final_eval_loss", "best_eval_loss", "final_eval_metric",
    "skipped_steps", "mean_step_time_s", "strategy_overhead_s", "strategy_overhead_frac", "diverged",
    "survived", "fingerprint", "segments", "primary",  # cell only when the run option is set
}


def test_run_record_follows_the_documented_format(tmp_path: Path) -> None:
    summary, rows = run_tiny(tmp_path, "train.steps=20", "train.log_every=5", "train.hist_every=10",
                             "train.eval_every=10", "precision=fp16", "strategy=native", "seed=3")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [5, 10, 15, 20] and [r["step"] for r in evals] == [10, 20]
    for r in train:
        assert TRAIN_KEYS <= set(r)
        assert set(r["act_zero_frac"]) == {"layers.0", "layers.1", "head"}
        assert r["scale"] == 65536.0 and r["skipped"] is False and r["skipped_total"] == 0
        assert r["grad_norm"] > 0 and 0 <= r["grad_zero_frac"] <= 1
        assert r["lr"] == pytest.approx(lr_at(r["step"], 20, 3e-3, 10, "cosine", 0.1), rel=1e-12)  # the default recipe
        assert 0 < r["strategy_time_s"] < r["step_time_s"]
    assert [("act_exp_hist" in r) for r in train] == [False, True, False, True]
    hist = train[1]["act_exp_hist"]
    assert hist["lo"] == -64 and sum(hist["counts"]) > 0
    assert set(summary) == SUMMARY_KEYS
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["status"] == "completed" and summary["steps"] == 20 and summary["diverged"] is False
    assert summary["survived"] is True and summary["primary"] == "final_eval_loss"  # the default workload's
    assert summary["workload"] == "mlp/vectors/plain" and summary["seed"] == 3 and summary["strategy"] == "native"
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["best_eval_loss"] == min(e["eval_loss"] for e in evals)
    assert 0 <= summary["final_eval_metric"] <= 1  # accuracy
    assert summary["final_train_loss"] == train[-1]["loss_avg"]
    assert 0 < summary["strategy_overhead_frac"] < 1
    fp = summary["fingerprint"]
    assert {"git_sha", "git_dirty", "config", "overrides", "torch_version", "device", "hostname"} <= set(fp)
    assert fp["config"]["seed"] == 3 and "seed=3" in fp["overrides"]


def test_fp16_without_scaling_underflows_and_native_closes_the_gap(tmp_path: Path) -> None:
    """The evidence the sandbox measures what it claims (loss x 1e-6, tiny MLP, 40 steps)."""
    common = ["regime=small_grad", "train.steps=40", "train.log_every=10", "train.eval_every=0",
              "model.width=64", "model.depth=3", "data.n_train=2048", "train.batch_size=64"]
    ref, _ = run_tiny(tmp_path / "fp32", *common, "precision=fp32", "strategy=none")
    bare, bare_rows = run_tiny(tmp_path / "none", *common, "precision=fp16", "strategy=none")
    nat, nat_rows = run_tiny(tmp_path / "native", *common, "precision=fp16", "strategy=native")
    first_bare = next(r for r in bare_rows if r["kind"] == "train")
    first_nat = next(r for r in nat_rows if r["kind"] == "train")
    # Unscaled fp16 loses (nearly) every activation gradient, layer by layer; scaled fp16 keeps them.
    assert len(first_bare["act_zero_frac"]) == 4
    assert all(frac > 0.9 for frac in first_bare["act_zero_frac"].values())
    assert all(frac < 0.1 for frac in first_nat["act_zero_frac"].values())
    gap_bare = bare["final_eval_loss"] - ref["final_eval_loss"]
    gap_nat = abs(nat["final_eval_loss"] - ref["final_eval_loss"])
    assert gap_bare > 0.2  # measurably worse than fp32
    assert gap_nat < 0.25 * gap_bare  # native closes most of the gap
    assert bare["strategy"] == "none" and first_bare["scale"] == 1.0


def test_divergence_stops_the_run(tmp_path: Path) -> None:
    summary, rows = run_tiny(tmp_path, "precision=fp32", "strategy=none", "optimizer.lr=50",
                             "train.steps=60", "train.log_every=2", "train.divergence_loss=20")
    assert summary["status"] == "diverged" and summary["diverged"] is True
    assert summary["steps"] < 60 and "divergence_loss" in summary["error"]
    last = [r for r in rows if r["kind"] == "train"][-1]
    assert not math.isfinite(last["loss"]) or last["loss"] > 20


def test_an_exception_is_recorded_as_failed_and_reraised(tmp_path: Path, monkeypatch) -> None:
    def broken_eval(*args, **kwargs):
        raise RuntimeError("eval exploded\nsecond line")

    monkeypatch.setattr(loop, "_evaluate", broken_eval)
    with pytest.raises(RuntimeError, match="eval exploded"):
        run_tiny(tmp_path, "train.steps=20", "train.log_every=5", "train.eval_every=10")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: eval exploded second line"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10]  # what was written before the failure is kept


def test_resume_continues_without_duplicates_and_a_finished_run_is_left_alone(tmp_path: Path) -> None:
    # A constant rate: a longer run may continue this one (a cosine schedule would be refused,
    # tests/experiments/test_resume_records.py).
    args = ("train.log_every=5", "train.checkpoint_every=10", "train.lr_decay=constant")
    first, _ = run_tiny(tmp_path, "train.steps=20", *args)
    before = (tmp_path / "metrics.jsonl").read_text()
    again, _ = run_tiny(tmp_path, "train.steps=20", *args)
    assert (tmp_path / "metrics.jsonl").read_text() == before and again == json.loads(json.dumps(first))
    longer, rows = run_tiny(tmp_path, "train.steps=30", *args)
    steps = [(r["kind"], r["step"]) for r in rows]
    assert len(steps) == len(set(steps))
    assert [s for k, s in steps if k == "train"] == [5, 10, 15, 20, 25, 30]
    assert longer["steps"] == 30 and longer["status"] == "completed"


@pytest.mark.parametrize("strategy", group_options("strategy"))
def test_every_strategy_trains_in_fp16(tmp_path: Path, strategy: str) -> None:
    summary, rows = run_tiny(tmp_path, f"strategy={strategy}", "precision=fp16", "regime=spikes",
                             "regime.spike_steps=[4]", "train.steps=12", "train.log_every=4")
    assert summary["status"] == "completed" and summary["strategy"] == ("none" if strategy == "none" else strategy)
    train = [r for r in rows if r["kind"] == "train"]
    assert all(math.isfinite(r["scale"]) and r["scale"] > 0 for r in train)
    if strategy in ("layerwise_adaloss", "underflow_target", "metaseq", "static8"):
        # They place S from measured statistics at the smallest scale that keeps the gradients
        # normal (adaloss starts at 1), or start small (metaseq at 4, static8 at 8): the x1e4
        # spike at step 4 fits, nothing is skipped.
        assert train[0]["skipped"] is False and summary["skipped_steps"] == 0
    elif strategy != "none":
        # The x1e4 spike at step 4 overflows fp16 at 2^16: the step is skipped and counted.
        assert train[0]["skipped"] is True and summary["skipped_steps"] >= 1
    for r in train:
        if "scales" in r:
            assert len(r["scales"]) == len(r["scale_groups"])


@pytest.mark.parametrize("model", ["gpt", "cnn"])
@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_workloads_run_in_every_precision(tmp_path: Path, model: str, precision: str) -> None:
    summary, rows = run_tiny(tmp_path, f"precision={precision}", "train.steps=4", "train.log_every=2",
                             model=model)
    assert summary["status"] == "completed" and summary["precision"] == precision
    assert math.isfinite(summary["final_eval_loss"])
    if model == "gpt":
        assert summary["final_eval_metric"] == pytest.approx(summary["final_eval_loss"] / math.log(2))
        assert set(rows[0]["act_zero_frac"]) == {"embed", "blocks.0", "ln_f", "head"}  # the layers (strategies.boundaries)


def test_an_attached_rule_pays_its_hooks_in_the_overhead(tmp_path: Path, monkeypatch) -> None:
    """strategy_time_s counts the strategy's boundary hooks (Strategy.hook_seconds), which run
    inside forward and backward where scale() to update() cannot see them: with a hook clock that
    advances 1 s per read, every step's strategy time is over 1 s."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(Strategy, "hook_seconds", property(lambda self: float(next(ticks))))
    _, rows = run_tiny(tmp_path, "train.steps=6", "train.log_every=1", "precision=fp16", "strategy=underflow_target")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 6 and all(r["strategy_time_s"] > 1.0 for r in train)


LOOP_MODULES = ("loop.py", "step.py", "recorder.py", "config.py")


def test_the_loop_reads_as_plain_code() -> None:
    """nanoGPT's shape (issue 23): no function defined inside another (no closures to trace), no
    function-local import, no strategy known by name, and the step is one function read whole."""
    folder = Path(loop.__file__).parent
    for name in LOOP_MODULES:
        source = (folder / name).read_text()
        for fn in (n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            inner = [n for n in ast.walk(fn) if n is not fn and isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Import, ast.ImportFrom))]
            assert not inner, f"{name}:{fn.name} defines or imports inside itself (line {inner[0].lineno})"
        assert not set(re.findall(r"[\"']([A-Za-z_]+)[\"']", source)) & set(strategies.available()), name
    step = next(n for n in ast.parse((folder / "step.py").read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    assert step.end_lineno - step.lineno + 1 <= 45  # torchtitan's forward_backward_step, nanoGPT's step
    for name in ("loop.py", "step.py"):
        for fn in (n for n in ast.walk(ast.parse((folder / name).read_text())) if isinstance(n, ast.FunctionDef)):
            assert fn.end_lineno - fn.lineno + 1 <= 80, f"{name}:{fn.name}"
