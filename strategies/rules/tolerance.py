"""``tolerance``: fairseq's dynamic loss scaler — back off only when overflows are frequent enough.

Rule (fairseq ``fairseq/optim/dynamic_loss_scaler.py``, ``DynamicLossScaler.check_overflow`` on
an overflow and ``DynamicLossScaler.update`` after a clean step), in GradScaler's keywords
(``growth_interval`` is fairseq's ``scale_window``; ``growth_factor`` its ``scale_factor``;
``backoff_factor`` = 1 / ``scale_factor``). With ``r`` the steps since the last rescale
(counting this one; fairseq ``_iter - _last_rescale_iter``), ``o`` the overflows since the last
backoff and ``t`` the clean steps since the last overflow (``growth_tracker``):

* overflow: ``o <- o + 1``, ``t <- 0``; if ``o / r >= tolerance``: ``S <- max(S * backoff_factor,
  threshold)`` (no floor when ``threshold`` is null), ``o <- 0``, ``r`` restarts;
* clean step: if ``t + 1 == growth_interval`` (fairseq: ``(_iter - _last_overflow_iter) %
  scale_window == 0``): ``S <- S * growth_factor`` (kept if not finite), ``t <- 0``, ``r`` restarts
  (``o`` is *not* reset, as in fairseq); else ``t <- t + 1``;
* ``min_scale`` with ``on_min_scale`` (:mod:`strategies.floor`): ``raise`` follows fairseq's
  ``min_loss_scale``: an overflow after which S <= ``min_scale`` restores the previous S and
  records a fault (``ScaleFloorError`` at the next ``step()``); ``clamp`` keeps S >= min_scale.

**window_follows_scale** (metaseq ``metaseq/optim/dynamic_loss_scaler.py``, "When scaling up
loss_scale, also scale up the scale_window"; "lower loss scale, smaller window"): the growth
window ``w`` (state ``scale_window``, starting at ``growth_interval``) is multiplied by
``growth_factor`` at each growth and by ``backoff_factor`` at each backoff (``max(floor(.), 1)``);
growth happens when ``(t + 1) % w == 0``, ``t`` the clean steps since the last overflow, which a
growth does *not* reset (metaseq's ``(_iter - _last_overflow_iter) % scale_window == 0``). So from
one overflow on, the scale grows after ``w``, ``w``, ``2w``, ``4w``, ... clean steps. Exactly
metaseq's arithmetic for ``growth_factor = 2 = 1 / backoff_factor`` (its ``scale_window *=
scale_factor`` and ``int(scale_window / scale_factor)``); metaseq keeps the scale at its previous
value when a backoff would take it below ``min_loss_scale``, which for power-of-two scales is
``clamp``.

``tolerance = 0`` (fairseq's default) backs off on every overflow, i.e. torch's rule. Defaults are
fairseq's: init 2^15, scale_window 2000, tolerance 0, threshold None, min_loss_scale 1e-4 (here
a clamp unless ``on_min_scale="raise"``). fairseq's guard ``iter_since_rescale == 0 -> 1000`` is
unreachable in its own loop (``r >= 1`` always) and is not reproduced.

Weakness, kept visible: with ``tolerance > 0`` a run that overflows now and then keeps its scale
and skips those steps for good; one outlier overflow costs one skipped step and (at tolerance 0)
halves S until ``growth_interval`` clean steps pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.floor import FLOOR_FAULT, FloorParams, raises, record_fault_
from strategies.params import ScalerParams, hp
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["ToleranceParams", "ToleranceStrategy", "tolerance_update_"]


def tolerance_update_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    since_rescale: torch.Tensor,
    overflows: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    tolerance: float,
    threshold: float | None,
    fault: torch.Tensor | None = None,
    min_scale: float | None = None,
    step: int = 0,
    scale_window: torch.Tensor | None = None,
) -> None:
    """fairseq's rule, in place on the device (no host sync); see the module docstring. The Python
    twin (and oracle) of the fused op ``torch.ops.scalelab.tolerance_update_`` (same arguments),
    which the strategy runs through :meth:`strategies.base.Strategy.run_update`.

    Args:
        scale: float32 S; growth_tracker: int32 t; since_rescale: int64 r (>= 1); overflows:
            int64 o; found_inf: float32, > 0 on a non-finite step.
        fault: int64 fault flag (``on_min_scale="raise"``) or None (clamp: the base clamps);
            with it, an overflow leaving S <= ``min_scale`` restores S and records ``step``.
        scale_window: int64 growth window w (``window_follows_scale``) or None (w =
            ``growth_interval``, reset of t at growth: fairseq).
    """
    found = found_inf != 0
    o1 = overflows + 1
    back = found & (o1.double() / since_rescale.double() >= tolerance)
    wide = scale.double()  # S * factor in double, rounded once (as native / torch)
    backed = (wide * backoff_factor).float()
    if threshold is not None:
        backed = torch.clamp(backed, min=threshold)
    t1 = growth_tracker + 1
    follow = scale_window is not None
    w = torch.clamp(scale_window, min=1) if follow else None  # a valid state has w >= 1 (as the op)
    grow = ~found & ((t1 % w == 0) if follow else (t1 == growth_interval))
    grown = (wide * growth_factor).float()
    new = torch.where(back, backed, scale)
    new = torch.where(grow & torch.isfinite(grown), grown, new)
    if fault is not None and min_scale is not None:
        hit = found & (new <= min_scale)
        record_fault_(fault, hit, step)
        new = torch.where(hit, scale, new)
    rescaled = back | grow
    scale.copy_(new)
    reset = found if follow else found | grow
    growth_tracker.copy_(torch.where(reset, torch.zeros_like(t1), t1))
    since_rescale.copy_(torch.where(rescaled, torch.ones_like(since_rescale), since_rescale + 1))
    overflows.copy_(torch.where(back, torch.zeros_like(o1), torch.where(found, o1, overflows)))
    if follow:
        wider = (w.double() * growth_factor).long()
        narrower = torch.clamp((w.double() * backoff_factor).long(), min=1)
        scale_window.copy_(torch.where(grow, wider, torch.where(back, narrower, scale_window)))


@dataclass
class ToleranceParams(FloorParams, ScalerParams):
    init_scale: float = hp(2.0**15, v.finite_positive, "fairseq DynamicLossScaler")
    growth_interval: int = hp(2000, v.integer(1), "fairseq DynamicLossScaler (scale_window)")
    min_scale: Optional[float] = hp(1e-4, v.optional(v.finite_positive), "fairseq DynamicLossScaler (min_loss_scale)")
    tolerance: float = hp(0.0, v.between(0.0, 1.0, "[]"), "fairseq DynamicLossScaler",
                          "back off when overflows / steps since the last rescale reach this fraction")
    threshold: Optional[float] = hp(None, v.optional(v.finite_positive), "fairseq DynamicLossScaler",
                                    "floor of the backed-off scale (null: none)")
    window_follows_scale: bool = hp(False, v.boolean, "metaseq DynamicLossScaler",
                                    "the growth window grows and shrinks with the scale (module docstring)")


def window_follows(params: ToleranceParams) -> bool:
    """Whether the rule keeps metaseq's growth window (the ``scale_window`` state)."""
    return bool(params.window_follows_scale)


@register_strategy("tolerance")
class ToleranceStrategy(Strategy):
    """fairseq's ``DynamicLossScaler``: back off only when the overflow fraction since the last
    rescale reaches ``tolerance``, floor the backed-off S at ``threshold`` (module docstring)."""

    Params = ToleranceParams
    state_spec = (
        State("since_rescale", torch.int64, 1, low=1),
        State("overflows_since_rescale", torch.int64, 0, low=0),
        FLOOR_FAULT,
        State("scale_window", torch.int64, "growth_interval", low=1, when=window_follows),
    )

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        # the host step number only where a fault can record it (on_min_scale="raise"): a Python value
        # that changes every step would be frozen into a captured CUDA graph (tests/strategies/test_capturable.py)
        self.run_update("tolerance_update_", tolerance_update_, overflows=self.state.overflows_since_rescale,
                        found_inf=found_inf, step=self.updates + 1 if raises(self.params) else 0)
