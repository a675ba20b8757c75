"""The app as users run it (subprocesses): kill-and-resume, a corrupt checkpoint, bad overrides,
and W&B offline. Each Hydra subprocess costs a few seconds, so there are few of them."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from experiments.app.train import group_options
from tests.experiments.runs import QUIET, TINY, cli, read_rows, run_tiny

# fp16 with a native scaler that grows every 3 clean steps and a spike at step 8: the scale
# trajectory moves both ways, so "same trajectory" means something.
RESUME = [*TINY["mlp"], *QUIET, "precision=fp16", "strategy=native", "strategy.init_scale=1024",
          "strategy.growth_interval=3", "regime=spikes", "regime.spike_steps=[8]", "train.steps=24",
          "train.log_every=2", "train.eval_every=6", "train.checkpoint_every=5", "train.deterministic=true"]


def _wandb_log_records(path: Path) -> list[bytes]:
    """Payloads of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    style records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks whose tails shorter than a record header are zero padding."""
    raw, block, out, pos, parts = path.read_bytes(), 32768, [], 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if kind == 0:
            break
        parts += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(parts)
            parts = b""
    return out


def _parse_record(data: bytes):
    from wandb.proto import wandb_internal_pb2

    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(data)
    return rec


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_killed_run_resumes_to_the_same_parameters_and_scale_trajectory(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    run_tiny(ref_dir, *RESUME[len(TINY["mlp"]) + len(QUIET):])
    killed = cli(*RESUME, f"hydra.run.dir={run_dir}", "train.kill_at_step=13")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == 10
    assert max(r["step"] for r in read_rows(run_dir)) == 12  # written after the checkpoint: to be dropped
    # Re-run in the same directory (in-process: the same code path the CLI takes after Hydra).
    run_tiny(run_dir, *RESUME[len(TINY["mlp"]) + len(QUIET):])
    ref_rows, rows = read_rows(ref_dir), read_rows(run_dir)
    key = lambda r: (r["kind"], r["step"])  # noqa: E731
    assert [key(r) for r in rows] == [key(r) for r in ref_rows]  # no duplicates, nothing missing
    train, ref_train = [r for r in rows if r["kind"] == "train"], [r for r in ref_rows if r["kind"] == "train"]
    assert [r["scale"] for r in train] == [r["scale"] for r in ref_train]
    assert len({r["scale"] for r in train}) >= 3 and any(r["skipped"] for r in train)
    assert [r["loss"] for r in train] == [r["loss"] for r in ref_train]
    ref_params, params = _final_params(ref_dir), _final_params(run_dir)
    assert all(torch.equal(ref_params[k], params[k]) for k in ref_params)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 24
    assert summary["skipped_steps"] == json.loads((ref_dir / "summary.json").read_text())["skipped_steps"]


def test_corrupt_checkpoint_is_a_clear_error_and_nothing_is_overwritten(tmp_path: Path) -> None:
    run_tiny(tmp_path, "train.steps=10", "train.checkpoint_every=5", "train.log_every=5")
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:300])
    mine = ("checkpoint.pt", "metrics.jsonl", "summary.json")
    before = {name: (tmp_path / name).read_bytes() for name in mine}
    result = cli(*TINY["mlp"], *QUIET, "train.steps=20", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "truncated or corrupt" in lines[0]
    after = {name: (tmp_path / name).read_bytes() for name in mine}
    assert after == before


@pytest.mark.parametrize(
    "override,message",
    [
        ("strategy=nope", "unknown strategy 'nope'; allowed values for strategy: " + ", ".join(group_options("strategy"))),
        ("model=transformer", "unknown model 'transformer'; allowed values for model: " + ", ".join(group_options("model"))),
        ("precision=fp4,fp16", "unknown precision 'fp4'; allowed values for precision: " + ", ".join(group_options("precision"))),
        ("train.steps=[1", "malformed override 'train.steps=[1'"),
    ],
)
def test_bad_choices_and_malformed_overrides_fail_before_hydra(override: str, message: str) -> None:
    result = cli(override)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"scalelab-train: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert message in result.stderr


def test_out_of_range_value_is_a_one_line_error(tmp_path: Path) -> None:
    result = cli(*QUIET, "regime.loss_multiplier=0", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "scalelab-train: error: regime.loss_multiplier must be a number in [1e-12, 1e+06], got 0"
    )
    assert not (tmp_path / "summary.json").exists()


def test_wandb_offline_run_directory_has_the_logged_keys(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    summary, rows = run_tiny(tmp_path, "logger=wandb", "logger.wandb.mode=offline", "train.steps=6",
                             "train.log_every=3", "train.hist_every=3", "sweep=wbtest")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    wb_file = next(runs[0].glob("run-*.wandb"))
    # run.finish() can return before W&B's service process has written the file; it is complete
    # once the service shuts down (at process exit; here: teardown). Then wait for the exit record.
    import wandb

    wandb.teardown()
    deadline = time.monotonic() + 60
    while True:
        records = [_parse_record(data) for data in _wandb_log_records(wb_file)]
        if any(rec.WhichOneof("record_type") == "exit" for rec in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    logged = {item.key or "/".join(item.nested_key)
              for rec in records if rec.WhichOneof("record_type") == "history" for item in rec.history.item}
    runs_info = [rec.run for rec in records if rec.WhichOneof("record_type") == "run"]
    assert len(runs_info) == 1, [rec.WhichOneof("record_type") for rec in records]
    run_info = runs_info[0]
    assert {"train/loss", "train/scale", "train/grad_norm", "train/act_zero_frac/head", "eval/eval_loss"} <= logged
    assert any(key.startswith("train/act_exp_hist") for key in logged)  # a wandb.Histogram
    assert run_info.run_group == "wbtest" and run_info.job_type == "native"
    assert "mlp" in run_info.tags and summary["status"] == "completed"


def test_a_single_run_into_a_log_prints_its_progress_and_its_result(tmp_path: Path) -> None:
    """stderr is a pipe here, as under nohup, SLURM or CI: no tqdm bar, but a plain line at each
    tenth of the steps (on the logging steps) and one result line naming the run directory."""
    done = cli(*TINY["mlp"], "logger=none", "threads=1", "train.steps=20", "train.log_every=2",
               f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("scalelab-train: ")]
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"scalelab-train: step (\d+)/20, loss \S+, "
                                                                   r"scale \S+, \d+ skipped \| \d+s$", line))]
    assert steps == list(range(2, 21, 2))
    summary = json.loads((tmp_path / "summary.json").read_text())
    who = f"{summary['precision']} plain {summary['strategy']}"
    assert lines[-1] == (f"scalelab-train: {who} seed 0: completed, final eval loss "
                         f"{summary['final_eval_loss']:.4g}, 0 skipped -> {tmp_path}")


def test_a_sweep_job_prints_no_lines_of_its_own(tmp_path: Path) -> None:
    """In a sweep the per-job line of experiments.app.progress is the only line a job adds."""
    done = cli("-m", *TINY["mlp"], "logger=none", "threads=1", "train.steps=4", "train.log_every=1", "seed=0,1",
               f"hydra.sweep.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert "scalelab-train: step " not in done.stderr and " -> " not in done.stderr
    assert len(re.findall(r"^\[\d/2\] .* seed \d: completed", done.stderr, flags=re.M)) == 2


@pytest.mark.parametrize("rule", ["norm_ratio", "hybrid", "layerwise_adaloss"])
def test_a_killed_run_of_a_rule_with_probe_or_group_state_resumes_bit_identical(tmp_path: Path, rule: str) -> None:
    """Issue 29 saw a killed and resumed norm_ratio run part from its uninterrupted twin: the fp32
    probe's counter (a probe every 4 steps: before and after the kill), the hybrid's calibration and
    the per-group scales must all come back from the checkpoint."""
    probe = ["strategy.probe_interval=4"] if rule != "layerwise_adaloss" else []
    args = [f"strategy={rule}", *probe, *RESUME[len(TINY["mlp"]) + len(QUIET) + 4:]]  # RESUME without its scaler
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    run_tiny(ref_dir, "precision=fp16", *args)
    killed = cli(*TINY["mlp"], *QUIET, "precision=fp16", *args, f"hydra.run.dir={run_dir}", "train.kill_at_step=13")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_tiny(run_dir, "precision=fp16", *args)
    train = [(r["step"], r["scale"], r["loss"]) for r in read_rows(run_dir) if r["kind"] == "train"]
    assert train == [(r["step"], r["scale"], r["loss"]) for r in read_rows(ref_dir) if r["kind"] == "train"]
    ref_params, params = _final_params(ref_dir), _final_params(run_dir)
    assert all(torch.equal(ref_params[k], params[k]) for k in ref_params)


def test_a_sweep_job_refused_for_a_bad_value_says_why_and_the_others_complete(tmp_path: Path) -> None:
    done = cli("-m", *TINY["mlp"], "logger=none", "threads=1", "train.steps=2", "strategy=native",
               "strategy.growth_interval=3,0,5", f"hydra.sweep.dir={tmp_path}")
    assert re.search(r"^\[\d/3\] failed before training \(.*strategy.growth_interval=0\): strategy: growth_interval "
                     r"must be an integer >= 1, got 0", done.stderr, flags=re.M), done.stderr
    assert [json.loads((tmp_path / k / "summary.json").read_text())["status"] for k in ("0", "2")] == ["completed"] * 2
