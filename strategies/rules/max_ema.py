"""``max_ema``: max-value scaling with EMA smoothing and growth/backoff limits.

Rule (seed 003, section 3.1 "基于梯度最大值与目标上界的动态缩放 (Max Value Scaling)", with its
defaults from section 4.6). Each :meth:`update`, with ``G`` the abs-max of the *unscaled*
gradients of the step and ``S`` the current scale:

* candidate ``c = target_max / G`` (target_max = 2^15 = 32768; 49152 = 0.75 * 65504 is the
  seed's aggressive choice; never above ``format_max``, 65504 for fp16): the scale that would
  put the largest scaled gradient at ``target_max``;
* EMA ``e <- d * e + (1 - d) * c`` with ``d = ema_decay = 0.99``; the first fed step
  initialises ``e <- c``;
* limits: ``e > S * growth_factor``  -> ``S <- S * growth_factor`` (growth capped);
  ``e < S / growth_factor`` -> ``S <- S * backoff_factor`` (a big drop backs off by one step);
  otherwise ``S <- e``;
* non-finite gradients: the step is skipped, ``S <- S * backoff_factor``, and the EMA is *not*
  fed (the bad step's abs-max says nothing about a safe scale).

Decisions this module makes where the seed is silent (documented, tested):

* **All-zero gradients** (``G == 0``, or ``c`` not finite because ``G`` is tinier than
  ``target_max / float32_max``): the candidate is +inf, which would poison the EMA forever. The
  EMA is not fed. With ``zero_grads="grow"`` (default) the step is read as total underflow —
  the case scaling exists for (under autocast, an fp16 activation gradient that flushes to zero
  makes every parameter gradient below it exactly zero) — and S grows by ``growth_factor``
  (the capped branch). ``zero_grads="keep"`` keeps S instead ("no information").
* **growth_interval** (default 1 = the rule acts every step, the seed's "逐批更新 + EMA"):
  the growth tracker counts consecutive finite steps (saturating at ``growth_interval``);
  an *upward* move is allowed only once it reaches ``growth_interval``, so after a skipped step
  S does not climb again for ``growth_interval`` steps (seed 4.6: growth_interval "limits how
  fast S recovers after a skipped step"). Downward moves are never delayed.
* **round_pow2** rounds every new S down to a power of two (exact scaling; ``layerwise``
  relies on it).
* A new scale that is not finite or not > 0 is rejected (S kept), as torch rejects a
  non-finite grown scale.
* ``cap_ema_on_overflow`` (default False = the seed's rule): an overflow at S shows that an EMA
  at or above S is unsafe, so the backed-off S also caps the EMA, ``e <- min(e, S')``. Without
  it a lagging EMA (d = 0.99 remembers ~100 steps) that sits above the overflow threshold —
  e.g. after the gradients grew — pulls S straight back up after each backoff, and the run
  alternates overflow / clean steps until the EMA decays (measured in the README).

Known weakness, kept visible: one outlier gradient makes ``c`` collapse for a step and drags
``e`` (and through the ``e < S / growth_factor`` branch, S) down; ``telemetry()`` exposes
``candidate``, ``ema`` and ``grad_absmax`` so the outlier and its effect can be seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.formats import FP16_MAX, round_down_pow2
from strategies.params import ScalerParams, hp
from strategies.schedule import StatsSchedule
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["MAX_EMA_STATE", "MaxEmaParams", "MaxEmaRule", "MaxEmaStrategy", "ZERO_GRADS_MODES", "max_ema_update_"]

ZERO_GRADS_MODES = ("grow", "keep")


def max_ema_update_(
    scale: torch.Tensor,
    ema: torch.Tensor,
    ema_steps: torch.Tensor,
    growth_tracker: torch.Tensor,
    candidate: torch.Tensor,
    found_inf: torch.Tensor,
    grad_absmax: torch.Tensor,
    target_max: float,
    ema_decay: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    round_pow2: bool,
    grow_on_zero: bool,
    cap_ema_on_overflow: bool = False,
) -> None:
    """The max-EMA rule, in place on the device (no host sync); elementwise, so every tensor
    may be a scalar ``[]`` or a per-group vector ``[G]`` (``layerwise`` uses the latter).

    Args:
        scale: float32, the scale S; updated.
        ema: float32, the EMA e of the candidate; updated when fed.
        ema_steps: int32, how many steps fed the EMA (0: not initialised); updated.
        growth_tracker: int32, consecutive finite steps, saturating at ``growth_interval``.
        candidate: float32, written with ``target_max / grad_absmax`` of this step (telemetry).
        found_inf: float32, > 0 where the step's gradients were non-finite.
        grad_absmax: float32, abs-max of the unscaled gradients.
        cap_ema_on_overflow: on a non-finite step also set ``e <- min(e, new S)`` (off: the
            seed's rule, EMA untouched).
        other arguments: the rule's hyper-parameters (see the module docstring).
    """
    found = found_inf != 0
    cand = (target_max / grad_absmax).to(torch.float32)
    candidate.copy_(cand)
    fed = ~found & torch.isfinite(cand) & (grad_absmax > 0)
    started = ema_steps > 0
    e_fed = torch.where(started, ema * ema_decay + cand * (1.0 - ema_decay), cand).to(torch.float32)
    e = torch.where(fed, e_fed, ema)

    t = torch.where(found, torch.zeros_like(growth_tracker),
                    torch.clamp(growth_tracker + 1, max=growth_interval))
    may_grow = t >= growth_interval

    up = (scale * growth_factor).to(torch.float32)
    down = (scale * backoff_factor).to(torch.float32)
    # "Below S / growth_factor" as S times the reciprocal (1 / growth_factor in double, which torch
    # rounds to float32), never a true division: torch on CUDA divides by a host scalar as a
    # multiplication by its reciprocal, the rule header multiplies too, so every device and the
    # kernels compute the same bits (growth_factor 2: S * 0.5 == S / 2 exactly).
    by_ema = torch.where(e > up, up, torch.where(e < scale * (1.0 / growth_factor), down, e))
    no_info = up if grow_on_zero else scale
    new = torch.where(found, down, torch.where(fed, by_ema, no_info))
    new = torch.where(~found & ~may_grow, torch.minimum(new, scale), new)
    if round_pow2:
        new = round_down_pow2(new)
    new = torch.where(torch.isfinite(new) & (new > 0), new, scale)

    if cap_ema_on_overflow:
        e = torch.where(found & (ema_steps > 0), torch.minimum(e, new), e)
    scale.copy_(new)
    ema.copy_(e)
    ema_steps.add_(fed.to(ema_steps.dtype))
    growth_tracker.copy_(t)


@dataclass
class MaxEmaRule:
    """The max-EMA rule's own hyper-parameters (shared by ``max_ema`` and ``layerwise``)."""

    target_max: float = hp(32768.0, v.finite_positive, "seed 003 §4.6",
                           "where the largest scaled gradient should land (<= format_max)")
    format_max: float = hp(FP16_MAX, v.finite_positive, "IEEE fp16", "largest finite value of the gradient format")
    ema_decay: float = hp(0.99, v.between(0.0, 1.0, "[)"), "seed 003 §4.6", "d of the EMA (0 = no smoothing)")
    zero_grads: str = hp("grow", v.choice(*ZERO_GRADS_MODES), "scalelab", "all-zero gradients: grow | keep")
    cap_ema_on_overflow: bool = hp(False, v.boolean, "scalelab", "an overflow also caps the EMA at the backed-off S")

    def check(self) -> None:
        super().check()  # type: ignore[misc]
        if self.target_max > self.format_max:
            v.fail("target_max", f"<= format_max ({self.format_max:g})", self.target_max)


@dataclass
class MaxEmaParams(MaxEmaRule, StatsSchedule, ScalerParams):
    init_scale: float = hp(2.0**15, v.finite_positive, "seed 003 §3.1 (starting value of max scaling)")
    growth_interval: int = hp(1, v.integer(1), "scalelab", "finite steps after an overflow before S may grow again")
    round_pow2: bool = hp(False, v.boolean, "scalelab", "round S down to a power of two after every update")


MAX_EMA_STATE = (
    State("ema", torch.float32, 0.0),
    State("ema_steps", torch.int32, 0, low=0),
    State("candidate", torch.float32, math.nan, saved=False),
)


@register_strategy("max_ema")
class MaxEmaStrategy(Strategy):
    """Max-value scaling: S follows an EMA of ``target_max / absmax(grads)``, growth capped at
    ``x growth_factor`` per update, big drops backed off by ``x backoff_factor``, non-finite
    steps skipped and backed off (seed 003, section 3.1; full rule in the module docstring)."""

    Params = MaxEmaParams
    state_spec = MAX_EMA_STATE
    needs_stats = True

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        g = stats.absmax.view(()) if stats.absmax.numel() == 1 else stats.absmax.amax()  # a view: no op
        self.run_update("max_ema_update_", max_ema_update_, found_inf=found_inf, grad_absmax=g,
                        grow_on_zero=self.params.zero_grads == "grow")
