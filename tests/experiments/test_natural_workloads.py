"""The natural workloads in the app (issue 30): ``finetune`` (the pretrained GPT on held-out text) and
``rl`` (GRPO on it, experiments/app/rl_step.py) train through the loop and leave what the court reads:
reward, KL to the initial policy and the fidelity probe's lost fraction against fp32 (of the RL loss),
skips and the scale, ``final_reward`` and ``survived``. In-process on tiny sizes; one short run of
each through ``scalelab-train`` is marked slow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from experiments.app import rl_step as rl
from experiments.app.build import ConfigError
from tests.experiments.runs import TINY, cli, run_tiny


def test_rl_run_records_reward_kl_and_the_rl_losss_fidelity(tmp_path: Path) -> None:
    summary, rows = run_tiny(tmp_path, "train.steps=8", "train.log_every=2", "train.eval_every=4",
                             "train.fidelity_every=4", "precision=fp16", "strategy=native", model="rl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    probes = [r for r in rows if r["kind"] == "fidelity"]
    assert summary["status"] == "completed" and summary["survived"] is True
    assert summary["workload"] == "gpt_pretrained/rl_vowels/plain" and summary["steps"] == 8
    assert all(0 <= r["reward"] <= 1 and r["kl_ref"] >= 0 and r["scale"] == 65536.0 for r in train)
    assert [e["step"] for e in evals] == [4, 8] and summary["final_reward"] == evals[-1]["eval_reward"]
    assert [p["step"] for p in probes] == [4, 8] and all(0 <= p["lost_frac"] <= 1 for p in probes)
    assert math.isfinite(summary["fidelity_lost_frac_mean"]) and summary["skipped_steps"] == 0


def test_rl_passes_share_one_rollout_and_the_second_moves_the_ratio(tmp_path: Path) -> None:
    """Steps 1 and 2 train on one rollout batch (data.passes=2), step 3 samples a new one."""
    seen = []
    real = rl.rl_step

    def spy(parts, *args, **kwargs):  # noqa: ANN001, ANN202 - the loop's call, recorded
        out = real(parts, *args, **kwargs)
        seen.append(parts.batch["rollout"])
        return out

    monkey = pytest.MonkeyPatch()
    monkey.setattr("experiments.app.loop.rl_step", spy)
    try:
        run_tiny(tmp_path, "train.steps=3", "train.log_every=1", model="rl")
    finally:
        monkey.undo()
    assert seen[0] is seen[1] and seen[2] is not seen[1]


def test_rl_checkpoints_must_fall_on_rollout_boundaries(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.checkpoint_every must be a multiple of data.passes=2"):
        run_tiny(tmp_path, "train.steps=4", "train.checkpoint_every=3", model="rl")


def test_rl_resumes_at_a_rollout_boundary(tmp_path: Path) -> None:
    """Killed after its checkpoint at step 4, the run resumes with a new rollout: the same records."""
    whole, rows = run_tiny(tmp_path / "a", "train.steps=6", "train.log_every=2", "train.checkpoint_every=2", model="rl")
    run_tiny(tmp_path / "b", "train.steps=4", "train.log_every=2", "train.checkpoint_every=2", model="rl")
    resumed, rows_b = run_tiny(tmp_path / "b", "train.steps=6", "train.log_every=2", "train.checkpoint_every=2",
                               model="rl")
    strip = ("step_time_s", "strategy_time_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in rows if r["kind"] == "train"] == \
        [{k: v for k, v in r.items() if k not in strip} for r in rows_b if r["kind"] == "train"]
    assert resumed["final_reward"] == whole["final_reward"]


def test_finetune_starts_from_the_pretrained_weights_for_every_seed(tmp_path: Path) -> None:
    a, _ = run_tiny(tmp_path / "a", "train.steps=2", "train.log_every=1", "train.eval_every=1", "seed=0",
                    "optimizer.lr=0", model="pretrainedgpt")
    b, _ = run_tiny(tmp_path / "b", "train.steps=2", "train.log_every=1", "train.eval_every=1", "seed=5",
                    "optimizer.lr=0", model="pretrainedgpt")
    assert a["final_eval_loss"] == b["final_eval_loss"]  # lr 0: the eval is the pretrained model's
    assert a["workload"] == "gpt_pretrained/finetune_chars/plain" and a["survived"] is True


def test_keep_fp32_is_recorded(tmp_path: Path) -> None:
    summary, _ = run_tiny(tmp_path, "train.steps=2", "model.keep_fp32=[head]", model="pretrainedgpt")
    assert summary["keep_fp32"] == ["head"] and summary["status"] == "completed"


def test_the_reference_policy_is_frozen() -> None:
    ref = rl.frozen_copy(torch.nn.Linear(2, 2))
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["rl", "pretrainedgpt"])
def test_a_short_run_through_scalelab_train(tmp_path: Path, workload: str) -> None:
    out = tmp_path / "run"
    proc = cli(*TINY[workload], "logger=none", "threads=1", "train.steps=6", "train.log_every=2",
               "train.eval_every=6", "train.fidelity_every=3", "precision=fp16", f"hydra.run.dir={out}",
               timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["fidelity_lost_frac_mean"] is not None
    assert (summary.get("final_reward") is not None) == (workload == "rl")


@pytest.mark.parametrize("model", ["pretrainedgpt", "rl"])
def test_seeds_draw_their_own_data(tmp_path: Path, model: str) -> None:
    """Every seed starts from the same pretrained weights, so only the data order (and the rollouts)
    tell seeds apart: they must differ (experiments.workloads.data.step_generator)."""
    losses = []
    for seed in (0, 1):
        _, rows = run_tiny(tmp_path / str(seed), "train.steps=4", "train.log_every=1", f"seed={seed}", model=model)
        losses.append([r["loss"] for r in rows if r["kind"] == "train"])
    assert losses[0] != losses[1]
