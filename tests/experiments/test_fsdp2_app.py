"""``scalelab-train distributed.mode=fsdp2`` on 2 gloo ranks (torchrun, CPU), end to end (issue 29).

The same tiny GPT, data and fp16 autocast, with a scale that grows every step until the fp16
backward overflows (``init_scale 2^15``, ``growth_interval 1``): ``native`` under FSDP2 must log
the same losses, scales and skipped steps, step by step, as torch's ``GradScaler`` (torch's scaler
for FSDP2) and ``ShardedGradScaler`` in its place on the same loop
(``tests/experiments/torch_scaler_train.py``). Against one process on the whole batch (in fp32:
in fp16 a rank's backward starts from its half batch's mean loss, so its activation gradients are
twice one process's and overflow at half the scale) the scales are the same and the gradient norms
and the final evaluation loss agree to float32 summation order (the logged training loss is rank
0's half batch's). The run writes one record (rank 0), completes, and its checkpoint holds the
full (gathered) tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.app.build import ConfigError
from experiments.app.config import RunConfig
from tests.experiments.runs import QUIET, REPO, TINY, cli, compose_cfg


ARGS = [*TINY["gpt"], *QUIET, "strategy=native", "strategy.init_scale=32768", "strategy.growth_interval=1",
        "train.steps=8", "train.log_every=1", "train.eval_every=0"]


def _torchrun(run_dir: Path, *args: str, script: str = "", scaler: str = "") -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", OMP_NUM_THREADS="1",
               SCALELAB_TORCH_SCALER=scaler)
    target = [str(REPO / script)] if script else ["-m", "experiments.app.train"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *target, *ARGS,
                           "distributed.mode=fsdp2", *args, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _record(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"], json.loads((run_dir / "summary.json").read_text())


def test_the_mode_is_a_typed_option() -> None:
    assert RunConfig.from_hydra(compose_cfg(*TINY["gpt"], *QUIET)).distributed.mode == "ddp"
    assert RunConfig.from_hydra(compose_cfg(*TINY["gpt"], *QUIET, "distributed.mode=fsdp2")).distributed.mode == "fsdp2"
    with pytest.raises(ConfigError, match="^distributed.mode must be one of ddp, fsdp2, got 'fsdp3'$"):
        RunConfig.from_hydra(compose_cfg(*TINY["gpt"], *QUIET, "distributed.mode=fsdp3"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_run_matches_torch_scalers_and_one_process(tmp_path: Path) -> None:
    _torchrun(tmp_path / "native", "precision=fp16")
    _torchrun(tmp_path / "grad", "precision=fp16", script="tests/experiments/torch_scaler_train.py", scaler="grad")
    _torchrun(tmp_path / "sharded", "precision=fp16", script="tests/experiments/torch_scaler_train.py",
              scaler="sharded")
    rows, summary = _record(tmp_path / "native")
    assert summary["status"] == "completed"
    assert [r["step"] for r in rows] == list(range(1, 9))  # one writer
    assert 0 < sum(r["skipped"] for r in rows) < 8, [(r["scale"], r["skipped"]) for r in rows]  # overflows, and steps
    for other in ("grad", "sharded"):
        theirs, _ = _record(tmp_path / other)
        for key in ("scale", "loss", "skipped"):
            assert [r[key] for r in theirs] == [r[key] for r in rows], (other, key)

    _torchrun(tmp_path / "fp32", "precision=fp32")
    single = cli(*ARGS, "precision=fp32", f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-3000:]
    (rows, summary), (one, one_summary) = _record(tmp_path / "fp32"), _record(tmp_path / "single")
    assert summary["status"] == one_summary["status"] == "completed"
    assert [r["scale"] for r in rows] == [r["scale"] for r in one]
    for a, b in zip(rows, one):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert summary["final_eval_loss"] == pytest.approx(one_summary["final_eval_loss"], rel=1e-4)
    state = torch.load(tmp_path / "fp32" / "checkpoint.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in state["model"].values())
    assert state["model"]["head.weight"].shape == torch.Size([256, 32])  # gathered, not rank 0's shard
