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

from typing import Any

import torch

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.registry import register_strategy
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


@register_strategy("native")
class NativeStrategy(Strategy):
    """Backoff/growth dynamic loss scaling — ``torch.amp.GradScaler``'s rule, optionally with
    Megatron-style hysteresis and a [min_scale, max_scale] clamp.

    Args:
        hysteresis: overflows tolerated before backing off, refilled at each growth
            (integer >= 1; 1 = torch's behaviour).
        other arguments: see :class:`strategies.base.Strategy`.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, **kwargs)
        self._hysteresis = v.int_at_least("hysteresis", hysteresis, 1)
        self._init_hysteresis_tracker = self._hysteresis

    def _init_extra_state(self, device: torch.device) -> None:
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=device
        )

    def _update_scale(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert self._scale is not None and self._growth_tracker is not None
        if self._hysteresis == 1:
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                found_inf,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
        else:
            kernels.dispatch(
                "native_update_",
                native_update_,
                self._scale,
                self._growth_tracker,
                self._hysteresis_tracker,
                found_inf,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                self._hysteresis,
            )

    def _extra_state_dict(self) -> dict[str, Any]:
        return {"hysteresis": self._hysteresis, "hysteresis_tracker": int(self._hysteresis_tracker.item())}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "hysteresis_tracker" in state:
            self._hysteresis_tracker.fill_(int(state["hysteresis_tracker"]))

    def _extra_telemetry(self) -> dict[str, torch.Tensor]:
        return {"hysteresis_tracker": self._hysteresis_tracker.clone()} if self._hysteresis > 1 else {}
