"""The training recipe around the optimizer: nanoGPT's learning-rate schedule and weight-decay
groups (karpathy/nanoGPT ``train.py``: ``get_lr`` and ``configure_optimizers``).

* **Schedule** (``train.lr_warmup``, ``train.lr_decay``, ``train.min_lr_ratio``): step ``t``
  (1-based; nanoGPT's iteration ``it = t - 1``) has ``lr * (it + 1) / (warmup + 1)`` during the
  warmup, then ``min_lr + ½ (1 + cos(π r)) (lr - min_lr)`` with ``r = (it - warmup) /
  (steps - warmup)`` and ``min_lr = min_lr_ratio * lr`` (``cosine``), or ``lr`` (``constant``).
  The rate is a function of the step alone, so a resumed run continues it exactly; a skipped step
  (non-finite gradients) advances it like any other, as in nanoGPT.
* **Weight decay on matrices only**: parameters with two or more dimensions (linear and embedding
  weights) get the optimizer's ``weight_decay``; biases and norm gains get none.
* **Loss**: :func:`loss`, the mean cross-entropy in fp32 (the loop's and the doctor's).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F

__all__ = ["DECAYS", "lr_at", "set_lr", "decay_groups", "loss"]

DECAYS = ("cosine", "constant")


def lr_at(step: int, steps: int, lr: float, warmup: int, decay: str, min_lr_ratio: float) -> float:
    """The learning rate of 1-based ``step`` of ``steps`` (see the module docstring)."""
    it = step - 1
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if decay == "constant" or steps <= warmup:
        return lr
    min_lr = min_lr_ratio * lr
    ratio = min(1.0, (it - warmup) / (steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def decay_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """nanoGPT's two groups: matrices with ``weight_decay``, everything else with none (empty
    groups left out)."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss: mean cross-entropy over every position (LM) or example (classifier), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
