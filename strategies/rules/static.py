"""``static``: a fixed loss scale — the baseline dynamic scaling improves on.

Rule (seed 003 §1, static loss scaling; also DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``
``LossScaler`` and Megatron-LM ``megatron/core/optimizer/grad_scaler.py`` ``ConstantGradScaler``,
whose ``update`` does nothing): S = ``init_scale`` (default 1024) for the whole run.

* a step whose gradients are non-finite is skipped (GradScaler's state machine, base class) and
  counted in ``skipped_steps``; **S does not change** — no backoff, ever;
* S never grows; ``growth_factor``, ``backoff_factor`` and ``growth_interval`` are accepted (and
  validated) as GradScaler's keywords but unused;
* ``init_scale`` outside ``[min_scale, max_scale]`` is refused at construction (one
  ``ValueError``, :class:`strategies.params.ScalerParams`): a fixed scale is never changed
  silently; ``update(new_scale)`` sets S by hand, as GradScaler (then clamped into the bounds).

Weakness, kept visible: too large a fixed S overflows on every step (training stops moving), too
small a one lets small gradients underflow; nothing corrects either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.params import ScalerParams, hp
from strategies.registry import register_strategy
from strategies.stats import GradStats

__all__ = ["StaticParams", "StaticStrategy", "static_update_"]


def static_update_(scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """The static rule: S is left as it is whatever ``found_inf`` says (no device work at all)."""


@dataclass
class StaticParams(ScalerParams):
    init_scale: float = hp(1024.0, v.finite_positive, "seed 003 §1", "the fixed scale S")


@register_strategy("static")
class StaticStrategy(Strategy):
    """Static loss scaling: S fixed at ``init_scale`` (1024); non-finite steps are skipped and
    S does not change (module docstring)."""

    Params = StaticParams

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        static_update_(self.state.scale, found_inf)
