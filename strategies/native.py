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

Optional ``min_scale`` / ``max_scale`` clamp after every update (base class). Both extras are off
by default, so ``native`` is bit-identical to ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.params import ScalerParams, hp
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats


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
    found = found_inf > 0
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


@dataclass
class NativeParams(ScalerParams):
    hysteresis: int = hp(1, v.integer(1), "Megatron-LM DynamicGradScaler (1 = torch)",
                         "overflows tolerated before backing off, refilled at each growth")


@register_strategy("native")
class NativeStrategy(Strategy):
    """Backoff/growth dynamic loss scaling — ``torch.amp.GradScaler``'s rule, optionally with
    Megatron-style hysteresis and a [min_scale, max_scale] clamp (module docstring)."""

    Params = NativeParams
    state_spec = (State("hysteresis_tracker", torch.int32, "hysteresis"),)

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        p, s = self.params, self.state
        if p.hysteresis == 1:  # exactly torch.amp.GradScaler
            torch._amp_update_scale_(s.scale, s.growth_tracker, found_inf,
                                     p.growth_factor, p.backoff_factor, p.growth_interval)
        else:
            kernels.dispatch("native_update_", native_update_, s.scale, s.growth_tracker,
                             s.hysteresis_tracker, found_inf, p.growth_factor, p.backoff_factor,
                             p.growth_interval, p.hysteresis)
