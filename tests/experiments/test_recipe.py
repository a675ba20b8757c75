"""The training recipe against nanoGPT's own code (karpathy/nanoGPT ``train.py``, re-stated)."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.workloads.models import GPT
from experiments.app.recipe import decay_groups, lr_at
from tests.experiments.runs import run_tiny


def nanogpt_get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT ``train.py`` ``get_lr``, verbatim but for the globals made arguments."""
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("steps,warmup", [(100, 10), (150, 0), (20, 19), (5000, 100)])
def test_the_schedule_is_nanogpts_get_lr(steps: int, warmup: int) -> None:
    for step in range(1, steps + 1):  # our 1-based step is nanoGPT's iteration step - 1
        ours = lr_at(step, steps, 6e-4, warmup, "cosine", 0.1)
        assert ours == pytest.approx(nanogpt_get_lr(step - 1, 6e-4, warmup, steps, 6e-5), rel=1e-12, abs=0)
    assert lr_at(steps, steps, 6e-4, warmup, "constant", 0.1) == 6e-4


def test_weight_decay_goes_to_matrices_only_like_configure_optimizers() -> None:
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    params = list(model.parameters())
    decay, no_decay = decay_groups(params, 0.1)
    # nanoGPT: "all weight tensors in matmuls + embeddings decay, all biases and layernorms don't"
    assert {id(p) for p in decay["params"]} == {id(p) for p in params if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in params if p.dim() < 2}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and no_decay["params"]


def test_a_run_logs_the_schedule_and_clips_like_the_recipe(tmp_path) -> None:
    summary, rows = run_tiny(tmp_path, "train.steps=12", "train.log_every=1", "train.lr_warmup=4",
                             "precision=fp32", "strategy=none", "optimizer.lr=1e-2")
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    assert lrs == pytest.approx([lr_at(s, 12, 1e-2, 4, "cosine", 0.1) for s in range(1, 13)], rel=1e-12)
    assert lrs[3] == pytest.approx(1e-2 * 4 / 5) and lrs[-1] > 1e-3  # warmup, then the cosine tail above min_lr
    assert summary["status"] == "completed"


@pytest.mark.parametrize("override,message", [
    ("train.lr_decay=linear", "train.lr_decay must be one of cosine, constant"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be a number in [0, 1]"),
    ("train.lr_warmup=-1", "train.lr_warmup"),
])
def test_bad_recipe_options_are_one_line_errors(tmp_path, override: str, message: str) -> None:
    from experiments.app.build import ConfigError
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_tiny(tmp_path, override)


def test_a_zero_weight_decay_keeps_one_group(tmp_path) -> None:
    from experiments.app.build import build_optimizer
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0}})
    assert len(build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]).param_groups) == 1
    cfg.optimizer.weight_decay = 0.1
    assert [g["weight_decay"] for g in build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2, 2)),
                                                             torch.nn.Parameter(torch.zeros(2))]).param_groups] == [0.1, 0.0]
