"""``amax_history``: TransformerEngine's delayed scaling, applied to the loss scale.

Rule (TransformerEngine ``transformer_engine/common/recipe/__init__.py`` ``DelayedScaling``
— ``margin`` (TE default 0), ``amax_history_len`` (1024), ``amax_compute_algo`` ``"max"`` |
``"most_recent"`` — and its amax/scale update ``transformer_engine/common/recipe/delayed_scaling.cu``
``amax_and_scale_update_impl::kernel``: the step's amax is written to the history every step,
the history rolls, amax = max of it or its latest entry, ``scale = (fp8_max * 2^-margin) / amax``
if amax is finite and > 0, else the scale is kept). Here the tensor is the whole set of
unscaled gradients and the format is the gradients' (fp16 by default: ``format_max`` = 65504).
Each :meth:`update`, with ``G`` the abs-max of the step's unscaled gradients and ``S`` the scale
the step ran at:

* every step is recorded, as TE records every step's amax: the step's ``R`` is appended to the
  history (the last ``history_len`` steps, oldest dropped; zeros before it fills, as TE's).
  ``R = G`` on a finite step. On a non-finite step the true amax is unknown, but some scaled
  gradient passed ``format_max``: ``R = format_max / S`` (float32, at most the largest finite
  float32 so that a saved state stays finite), its lower bound, so the
  history remembers the overflow and the scale does not return to it for ``history_len`` steps;
* finite step: ``A`` = max of the history (``algo="max"``) or ``R`` (``"most_recent"``);
  ``S <- (format_max * 2^-margin) / A`` in float32 — kept when ``A`` is 0 or not finite (TE) or
  when the quotient is not finite (``A`` subnormal; as torch rejects a non-finite grown scale);
* non-finite step: skipped (base class), ``S <- S * backoff_factor`` (TE keeps S on a
  non-finite amax; a loss scale must back off so the next step can succeed);
* before the first finite step S = ``init_scale``.

``margin`` defaults to 1 here, not TE's 0: TE's FP8 casts saturate and it records the amax of
the high-precision tensor, so a growing tensor never fails a step; an fp16 gradient that grows
past ``format_max / S`` overflows and the step is skipped, and the activation gradients inside
the backward pass (which the parameter gradients' ``G`` does not see) run larger than ``G``. With
margin 0 a benign fp16 run skipped steps (``S * G`` was 61745 < 65504 on a skipped step: an
activation gradient overflowed); margin 1 puts the largest scaled gradient at 32752, the
"safety margin" target 32768 = 2^15 of seed 003 §3.1, and the same runs skip none (the
``te_delayed`` preset keeps TE's other defaults with this margin). With margin 0 the lower bound
``R`` equals the history's amax (``S`` was ``format_max / A``), so recording it changes nothing.

``growth_factor`` and ``growth_interval`` are accepted as GradScaler's keywords but unused: S
jumps straight to the history's value. Weakness, kept visible: one outlier ``G`` (or one
overflow's bound) lowers S for ``history_len`` steps with ``algo="max"`` (1024 by default), and
with ``most_recent`` S follows every step's noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.formats import FP16_MAX
from strategies.params import ScalerParams, hp
from strategies.schedule import StatsSchedule
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["AMAX_ALGOS", "AmaxHistoryParams", "AmaxHistoryStrategy", "amax_history_update_"]

AMAX_ALGOS = ("max", "most_recent")


def amax_history_update_(
    scale: torch.Tensor,
    history: torch.Tensor,
    found_inf: torch.Tensor,
    grad_absmax: torch.Tensor,
    format_max: float,
    scaled_max: float,
    backoff_factor: float,
    most_recent: bool,
) -> None:
    """The delayed-scaling rule, in place on the device (no host sync); the Python twin of
    ``torch.ops.scalelab.amax_history_update_`` (``cuda/include/rules/amax_history.h``).

    Args:
        scale: float32 S; history: float32 ``[L]``, newest last; found_inf: float32 flag
        (nonzero: overflow); grad_absmax: float32 abs-max of the unscaled gradients, per group
        (``[G]``; their max is the step's); format_max: the gradients' largest finite value;
        scaled_max: ``format_max * 2^-margin``; most_recent: ``algo == "most_recent"``.
    """
    found = found_inf != 0
    f32 = dict(dtype=torch.float32, device=scale.device)
    # an overflowed step's amax is at least this (at most FLT_MAX: a saved state holds finite numbers)
    bound = (torch.tensor(format_max, **f32) / scale).clamp(max=torch.finfo(torch.float32).max)
    record = torch.where(found, bound, grad_absmax.amax().to(torch.float32))
    hist = torch.cat([history[1:], record.reshape(1)])
    amax = record if most_recent else hist.amax()
    target = torch.tensor(scaled_max, **f32) / amax
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(target)
    backed = (scale.double() * backoff_factor).float()
    scale.copy_(torch.where(found, backed, torch.where(ok, target, scale)))
    history.copy_(hist)


@dataclass
class AmaxHistoryParams(StatsSchedule, ScalerParams):
    history_len: int = hp(1024, v.integer(1), "TransformerEngine DelayedScaling (amax_history_len)",
                          "steps whose gradient abs-max (an overflow: its lower bound) is remembered")
    algo: str = hp("max", v.choice(*AMAX_ALGOS), "TransformerEngine DelayedScaling (amax_compute_algo)",
                   "amax from the history: max | most_recent")
    margin: float = hp(1.0, v.between(0.0, 64.0, "[)"), "TransformerEngine DelayedScaling (default 0); 1: "
                       "seed 003 §3.1's 2^15 target", "S = format_max / amax / 2^margin")
    format_max: float = hp(FP16_MAX, v.finite_positive, "IEEE fp16", "largest finite value of the gradient format")


@register_strategy("amax_history")
class AmaxHistoryStrategy(Strategy):
    """TransformerEngine delayed scaling on the loss scale: S = format_max / amax / 2^margin with
    amax from the last ``history_len`` steps' gradient abs-max, an overflowed step's lower bound
    format_max / S included (module docstring)."""

    Params = AmaxHistoryParams
    state_spec = (State("amax_history", torch.float32, 0.0, low=0.0, length="history_len"),)
    needs_stats = True

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        p = self.params
        self.run_update("amax_history_update_", amax_history_update_, history=self.state.amax_history,
                        found_inf=found_inf, grad_absmax=stats.absmax, scaled_max=p.format_max * 2.0 ** -p.margin,
                        most_recent=p.algo == "most_recent")
