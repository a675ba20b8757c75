"""``native``: backoff/growth dynamic loss scaling, exactly ``torch.amp.GradScaler``.

Rule (torch's ``_amp_update_scale_``, see ``aten/src/ATen/native/cuda/AmpKernels.cu`` and
seed 000): with ``found_inf`` the step's non-finite flag and ``t`` the growth tracker,

* ``found_inf``:            S <- S * backoff_factor;  t <- 0
* else, ``t + 1 == growth_interval``: S <- S * growth_factor if that is finite (else S kept); t <- 0
* else:                     t <- t + 1

Optional **hysteresis** ``H >= 1`` (default 1 = torch) follows Megatron-LM's
``DynamicGradScaler``: an overflow resets ``t`` and spends one unit of a budget ``h`` (initially
``H``); S backs off only once the budget is spent (``h <= 0``), and every further overflow
backs off again until the next growth, which refills ``h <- H``. Chosen over DeepSpeed's
``delayed_shift`` because it keeps torch's tracker semantics unchanged (t resets on every
overflow, growth needs ``growth_interval`` consecutive clean steps) and only delays the
backoff; DeepSpeed's variant also changes when growth happens (``(iter - last_overflow) %
scale_window``) and, with ``consecutive_hysteresis``, refills the budget on every clean step.

**hysteresis_refill** (with ``H > 1``): ``growth`` (default) refills the budget at each growth,
as above — Megatron-LM ``megatron/core/optimizer/grad_scaler.py`` ``DynamicGradScaler.update`` and
DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale`` with
``consecutive_hysteresis=False`` (the default). ``clean_step`` refills it after *every* clean step,
so only ``H`` overflows in a row back off — DeepSpeed ``consecutive_hysteresis=True`` and Apex
``csrc/update_scale_hysteresis.cu`` ``update_scale_hysteresis_cuda_kernel``
(:func:`refill_on_clean_step_`, run after the update).

**on_min_scale** (:mod:`strategies.floor`): ``clamp`` (default) keeps S at ``min_scale``;
``raise`` records a fault when an overflow that would back off (budget spent) arrives with S
already at ``min_scale`` — DeepSpeed ``DynamicLossScaler.update_scale`` with
``raise_error_at_min_scale=True`` (``cur_scale == min_scale``) — and the next ``step()`` raises
:class:`strategies.base.ScaleFloorError` naming the step.

Optional ``min_scale`` / ``max_scale`` clamp after every update (base class). All extras are off
by default, so ``native`` is bit-identical to ``torch.amp.GradScaler`` (its default path calls
``torch._amp_update_scale_`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.floor import FLOOR_FAULT, FloorParams, record_fault_
from strategies.params import ScalerParams, hp
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = [
    "HYSTERESIS_REFILL", "NativeParams", "NativeStrategy", "native_floor_hit", "native_update_",
    "refill_on_clean_step_",
]


def native_update_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> None:
    """Megatron-style backoff/growth with hysteresis, in place on the device (no host sync): the
    Python twin of ``torch.ops.scalelab.native_update_`` (same arguments). With ``hysteresis``
    1, ``scale`` and ``growth_tracker`` follow ``torch._amp_update_scale_`` exactly.

    Args:
        scale: float32 S; growth_tracker: int32 t; hysteresis_tracker: int32 h; updated.
        found_inf: float32, > 0 when the step's gradients were non-finite.
        other arguments: the rule's hyper-parameters (see the module docstring).
    """
    found = found_inf != 0
    h_after = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    backoff = found & (h_after <= 0)
    t_after = torch.where(found, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = ~found & (t_after == growth_interval)
    # S * factor in double, rounded once to float: what torch._amp_update_scale_ computes.
    wide = scale.double()
    grown = (wide * growth_factor).float()
    new_scale = torch.where(backoff, (wide * backoff_factor).float(), scale)
    new_scale = torch.where(grow & torch.isfinite(grown), grown, new_scale)
    scale.copy_(new_scale)
    growth_tracker.copy_(torch.where(grow, torch.zeros_like(t_after), t_after))
    hysteresis_tracker.copy_(torch.where(grow, torch.full_like(h_after, hysteresis), h_after))


def refill_on_clean_step_(hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, hysteresis: int) -> None:
    """``h <- H`` after every clean step (Apex ``update_scale_hysteresis_cuda_kernel``: "Reset the
    hysteresis tracker if no infs are found"; DeepSpeed ``consecutive_hysteresis=True``). In place,
    no host sync; run after :func:`native_update_`, which refills only at growth."""
    hysteresis_tracker.copy_(torch.where(found_inf != 0, hysteresis_tracker, torch.full_like(hysteresis_tracker, hysteresis)))


def native_floor_hit(scale: torch.Tensor, hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor,
                     min_scale: float) -> torch.Tensor:
    """DeepSpeed's ``raise_error_at_min_scale`` condition, before the update: an overflow that
    backs off (budget spent: ``h - 1 <= 0``) while S is already at ``min_scale``."""
    return (found_inf != 0) & (hysteresis_tracker - 1 <= 0) & (scale <= min_scale)


HYSTERESIS_REFILL = ("growth", "clean_step")


@dataclass
class NativeParams(FloorParams, ScalerParams):
    hysteresis: int = hp(1, v.integer(1), "Megatron-LM DynamicGradScaler (1 = torch)",
                         "overflows tolerated before backing off")
    hysteresis_refill: str = hp("growth", v.choice(*HYSTERESIS_REFILL),
                                "Megatron-LM/DeepSpeed (growth); DeepSpeed consecutive_hysteresis, Apex (clean_step)",
                                "when the hysteresis budget refills: at each growth | after every clean step")


@register_strategy("native")
class NativeStrategy(Strategy):
    """Backoff/growth dynamic loss scaling — ``torch.amp.GradScaler``'s rule, optionally with
    Megatron-style hysteresis and a [min_scale, max_scale] clamp (module docstring)."""

    Params = NativeParams
    state_spec = (State("hysteresis_tracker", torch.int32, "hysteresis"), FLOOR_FAULT)

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        p, s = self.params, self.state
        if p.on_min_scale == "raise":
            hit = native_floor_hit(s.scale, s.hysteresis_tracker, found_inf, p.min_scale)
            record_fault_(s.fault, hit, self.updates + 1)
        if p.hysteresis == 1:  # exactly torch.amp.GradScaler (a budget of 1 never needs a refill)
            torch._amp_update_scale_(s.scale, s.growth_tracker, found_inf,
                                     p.growth_factor, p.backoff_factor, p.growth_interval)
        else:
            self.run_update("native_update_", native_update_, found_inf=found_inf)
            if p.hysteresis_refill == "clean_step":
                refill_on_clean_step_(s.hysteresis_tracker, found_inf, p.hysteresis)
