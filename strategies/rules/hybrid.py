"""``hybrid``: max-value scaling every step, calibrated against an fp32 reference (max–norm hybrid).

Rule (seed 003, section 3.3 "混合策略 — Max-Norm混合": "mainly max-value scaling, to react fast to
overflow risk and use the range, and periodically (e.g. every 100 steps) or when potential
underflow is detected, a norm-ratio calibration or large adjustment"). Each :meth:`update`, with
``S`` the scale the step's gradients were computed at:

1. **The max rule** (``max_ema``, seed 003 §3.1, :func:`strategies.rules.max_ema.max_ema_update_`
   with the same fields and defaults: target_max 32768, EMA decay 0.99, growth capped at
   ``x growth_factor``, a drop of the EMA below ``S / growth_factor`` -> ``x backoff_factor``,
   non-finite -> skip + ``x backoff_factor`` with the EMA not fed) gives ``S_max``.
2. **The zero-jump trigger.** ``z_k = zeros / numel`` of the step's gradients (the statistics
   pass, counted as they arrived, i.e. scaled); ``jump_k = z_k - z_{k-1} > zero_jump``, with
   ``z_{-1} = 1`` (no step before the first, so no jump). A fraction of all gradient entries
   that becomes exactly zero from one step to the next is the footprint of an underflow (an fp16
   activation gradient flushed to zero zeroes every parameter gradient below it).
3. **The calibration** (the ``norm_ratio`` probe and thresholds, seed 003 §3.2 / §4.6,
   :func:`strategies.probe.ratio_probe_`): on a *calibration step* — a scheduled one
   (``k % probe_interval == 0``, default 100, the seed's example; the first step included) or
   a step with ``jump_k`` — the ratio ``r = ||g_fp32|| / ||g_mp / S||`` over the probed
   parameters gives ``log2 r`` (clamped to [-16, 16]) -> ``m`` (EMA over calibration steps with
   ``ratio_ema_decay``, default 0: each calibration reads its own step) and
   ``r_bar = 2^m``: ``r_bar > threshold_high`` (8) -> ``a = growth_factor``;
   ``r_bar < threshold_low`` (1/8) -> ``a = backoff_factor``; else ``a = 1``.
4. **Override.** Where the calibration is valid (a finite step, both norms finite and not both
   0) and ``a != 1``: ``S <- S * a`` instead of ``S_max`` (a non-finite result is rejected),
   and the max rule's EMA is *re-seeded* at the calibrated scale, ``e <- S * a`` (marked
   started, so the next candidate is blended into it instead of replacing it); the probe's
   decision wins for that step, and the max rule then moves on from there. ``a == 1`` (or an
   invalid probe): ``S_max`` stands. ``calibrations`` counts the overrides.

Without a reference closure (:meth:`set_reference`) the rule warns once and is exactly
``max_ema`` (same state, same trajectory; tested).

**How the zero-jump trigger avoids a host read (the choice).** The jump of step ``k`` is known
only on the device, after the statistics pass of step ``k``; the probe must run in
:meth:`unscale_` of that same step, before ``optimizer.step()``, so both gradients are taken at
the same parameters. Reading the flag on the host there would be a sync that the contract
forbids, and the one existing sync — ``step()``'s skip decision (``found_inf.item()``) — comes
*after* ``unscale_`` (and does not exist at all with fused optimizers), so no existing sync can
decide whether to run the closure. Therefore, while ``zero_jump`` is set, **the fp32 reference
runs on every step** (host schedule: always) and the jump decides on the device, through
``torch.where``, whether its result acts; the scheduled steps act regardless. The price is one
fp32 forward + backward over the probed parameters per step — ``probe_count`` and
``probe_time_s`` report it; ``probe_layers`` restricts it to a few layers. ``zero_jump: null``
turns the trigger off, and the reference then runs only on the scheduled steps, like
``norm_ratio``'s. The raw ratio of every reference run is in telemetry (``norm_ratio``), the
step's trigger in ``zero_jumped``.

**Default zero_jump = 0.1** (scalelab's choice): ten percentage points of *all* gradient entries
turning exactly zero in one step. Structural zeros (ReLU dead units, unused embedding rows)
change slowly; a flushed activation gradient zeroes whole layers at once — the tests' 3-layer
fp16 MLP goes from 0 to 100 % zeros in one step at a too-small scale — while the step-to-step
change on a healthy scale is a few points at most (on the tests' MLP, exactly 0). Too small a
threshold makes noise calibrate; too large misses a one-layer flush in a deep net (one layer of
twelve is about 8 % of the entries), so set it to about the smallest layer share you must watch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.formats import round_down_pow2
from strategies.rules.max_ema import MAX_EMA_STATE, MaxEmaParams, max_ema_update_
from strategies.params import hp
from strategies.probe import PROBE_STATE, ProbeRule, ReferenceProbe, ratio_probe_
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["HYBRID_STATE", "HybridParams", "HybridStrategy", "hybrid_hparams", "hybrid_update_"]


@dataclass
class HybridParams(ProbeRule, MaxEmaParams):
    """``max_ema``'s fields and defaults, the probe's (``norm_ratio``'s) fields, and the trigger."""

    probe_interval: int = hp(100, v.integer(1), "seed 003 §3.3 (每100步)", "steps between scheduled calibrations")
    ratio_ema_decay: float = hp(0.0, v.between(0.0, 1.0, "[)"), "scalelab",
                                "EMA of log2 r over calibrations (0: each calibration reads its own step)")
    zero_jump: Optional[float] = hp(0.1, v.optional(v.between(0.0, 1.0)), "scalelab",
                                    "rise of the zero fraction in one step that triggers a calibration "
                                    "(null: off; set: the reference runs every step)")


HYBRID_STATE = (
    State("log_ratio_ema", torch.float32, 0.0),
    State("ratio_steps", torch.int32, 0, low=0),
    State("calibrations", torch.int64, 0, low=0),
    State("zero_frac_prev", torch.float32, 1.0, low=0.0),
    State("zero_jumped", torch.float32, 0.0, saved=False),
)


def hybrid_update_(
    scale: torch.Tensor, ema: torch.Tensor, ema_steps: torch.Tensor, growth_tracker: torch.Tensor,
    candidate: torch.Tensor, log_ratio_ema: torch.Tensor, ratio_steps: torch.Tensor, last_ratio: torch.Tensor,
    calibrations: torch.Tensor, zero_frac_prev: torch.Tensor, zero_jumped: torch.Tensor,
    found_inf: torch.Tensor, grad_absmax: torch.Tensor, zero_frac: torch.Tensor,
    ref_sumsq: torch.Tensor, mp_sumsq: torch.Tensor, probed: bool, scheduled: bool,
    target_max: float, ema_decay: float, growth_factor: float, backoff_factor: float, growth_interval: int,
    round_pow2: bool, grow_on_zero: bool, cap_ema_on_overflow: bool, zero_jump: Optional[float],
    threshold_high: float, threshold_low: float, ratio_ema_decay: float,
) -> None:
    """The hybrid rule, in place on the device (no host sync); the Python twin of
    ``torch.ops.scalelab.hybrid_update_`` (``cuda/include/rules/hybrid.h``). Scalar tensors
    but ``grad_absmax``.

    Args:
        scale, ema, ema_steps, growth_tracker, candidate: the max-EMA state
            (:func:`strategies.rules.max_ema.max_ema_update_`).
        log_ratio_ema, ratio_steps, last_ratio: the probe's EMA of log2 r, its count of valid
            calibrations, the raw r of this step's reference (:func:`strategies.probe.ratio_probe_`).
        calibrations: int64, incremented where the calibration overrode the max rule.
        zero_frac_prev: float32, the previous step's zero fraction (written with this step's).
        zero_jumped: float32, written with 1.0 where this step's zero fraction jumped.
        found_inf, zero_frac: this step's statistics (float32); grad_absmax: float32 abs-max per
            group (``[G]``; their max is the step's).
        ref_sumsq, mp_sumsq: the reference and mixed-precision sums of squares (ignored unless
            ``probed``).
        probed: a reference ran this step (host bool); scheduled: this is a scheduled
            calibration step (host bool) — otherwise the probe acts only where the zero fraction
            jumped.
        other arguments: the hyper-parameters (:class:`HybridParams`, in the order of
            :func:`hybrid_hparams`).
    """
    s0 = scale.clone()
    max_ema_update_(scale, ema, ema_steps, growth_tracker, candidate, found_inf, grad_absmax.amax(), target_max,
                    ema_decay, growth_factor, backoff_factor, growth_interval, round_pow2, grow_on_zero,
                    cap_ema_on_overflow)
    z = zero_frac.to(torch.float32)
    jump = (z - zero_frac_prev > zero_jump) if zero_jump is not None else torch.zeros_like(z, dtype=torch.bool)
    zero_frac_prev.copy_(z)
    zero_jumped.copy_(jump)
    if not probed:
        return
    acted, moved = ratio_probe_(s0, log_ratio_ema, ratio_steps, last_ratio, found_inf, ref_sumsq, mp_sumsq,
                                None if scheduled else jump, growth_factor, backoff_factor,
                                threshold_high, threshold_low, ratio_ema_decay)
    if round_pow2:
        moved = round_down_pow2(moved)
    scale.copy_(torch.where(acted, moved, scale))
    ema.copy_(torch.where(acted, moved, ema))
    ema_steps.copy_(torch.where(acted, ema_steps.clamp(min=1), ema_steps))
    calibrations.add_(acted.to(calibrations.dtype))


def hybrid_hparams(p: HybridParams) -> tuple:
    """The hyper-parameter arguments of :func:`hybrid_update_` (after ``scheduled``), from ``p``."""
    return (p.target_max, p.ema_decay, p.growth_factor, p.backoff_factor, p.growth_interval, p.round_pow2,
            p.zero_grads == "grow", p.cap_ema_on_overflow, p.zero_jump, p.threshold_high, p.threshold_low,
            p.ratio_ema_decay)


@register_strategy("hybrid")
class HybridStrategy(ReferenceProbe, Strategy):
    """Max–norm hybrid: ``max_ema`` every step, overridden by a norm-ratio calibration against an
    fp32 reference every ``probe_interval`` (100) steps and whenever the gradient zero fraction
    jumps by more than ``zero_jump`` (seed 003 §3.3; full rule and costs in the module docstring).
    Give the reference with :meth:`set_reference`; without one it is ``max_ema``."""

    Params = HybridParams
    state_spec = MAX_EMA_STATE + HYBRID_STATE + PROBE_STATE
    needs_stats = True
    probe_fallback = "max_ema"

    def probe_due(self) -> bool:
        """Every step while the zero-jump trigger is on (it acts on the device); else the schedule."""
        return self.params.zero_jump is not None or super().probe_due()

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        probed, ref, mp = self.probe_sums()
        self.run_update("hybrid_update_", hybrid_update_, last_ratio=self.state.norm_ratio, found_inf=found_inf,
                        grad_absmax=stats.absmax, zero_frac=stats.fraction(stats.zeros), ref_sumsq=ref, mp_sumsq=mp,
                        probed=probed, scheduled=ReferenceProbe.probe_due(self),
                        grow_on_zero=self.params.zero_grads == "grow")
