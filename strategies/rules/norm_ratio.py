"""``norm_ratio``: norm-ratio scaling against a periodic fp32 reference gradient.

Rule (seed 003, section 3.2 "基于梯度范数比例的自适应缩放 (Norm Ratio Scaling)", thresholds from
section 4.6). Every ``probe_interval`` steps the strategy differentiates an fp32 reference loss
and compares norms over the probed parameters P:

    r = ||g_fp32||_2 / ||g_mp / S||_2

where ``g_mp / S`` are the unscaled mixed-precision gradients of the same step. ``r >> 1`` means
the mixed-precision gradient lost mass (underflow), ``r << 1`` that it gained some (overflow
clipped to the format's max, or a broken fp32 side). Precisely, on a probe step:

1. ``log2 r`` (clamped to [-16, 16] so that a fully underflowed ``||g_mp|| = 0`` reads as a very
   large, finite ratio) feeds a geometric EMA ``m <- d * m + (1 - d) * log2 r``, initialised to
   ``log2 r`` at the first valid probe (``d = ema_decay = 0.5``; 0 = no smoothing). Averaging
   the logarithm treats a ratio of 8 and of 1/8 symmetrically.
2. With ``r_bar = 2^m``: ``r_bar > threshold_high`` (8) -> ``a = growth_factor`` (x2);
   ``r_bar < threshold_low`` (0.125) -> ``a = backoff_factor`` (x0.5); otherwise ``a = 1``.
   So a probe never moves S by more than the growth/backoff limits.
3. ``a != 1``: ``S <- S * a`` (a non-finite result is rejected) and the growth tracker restarts;
   this replaces the backoff/growth rule for that step. ``a == 1``: the step follows the
   backoff/growth rule below.

Every other step — and every step while no closure is set (a warning is issued once) — follows
``torch.amp.GradScaler``'s backoff/growth rule (``torch._amp_update_scale_``: overflow ->
``x backoff_factor``; ``growth_interval`` clean steps in a row -> ``x growth_factor``). A step with
non-finite gradients is skipped and backed off, probe or not; its probe result is discarded
(EMA not fed). A probe whose reference norm is not finite, or where both norms are 0, is
discarded too.

Where the probe runs and what it costs: in :meth:`unscale_` (called by :meth:`step` if the loop
did not call it) of every step ``k`` with ``k % probe_interval == 0`` (k counts :meth:`update`
calls from 0, skipped steps included, so the first step probes), at the first optimizer unscaled
in that step — i.e. *before* any ``optimizer.step()`` changes the parameters, so both gradients
are taken at the same point. The closure recomputes the loss of the current batch; the strategy
runs it with autocast disabled and differentiates it with ``torch.autograd.grad(loss, P)``,
which never touches ``.grad``. The probe is not a training step: nothing is applied. Its cost
(one fp32 forward + backward over P, plus the norm of P's unscaled mixed-precision gradients) is
the only extra work of this strategy; ``telemetry()`` reports ``probe_count``, ``probe_time_s``
(cumulative host wall time from ``time.perf_counter``: on CUDA this is the time to *enqueue* the
probe, not to run it, because no sync is allowed), ``probe_last_time_s``, ``norm_ratio`` (last
raw r) and ``log_ratio_ema`` (m = log2 r_bar, the EMA of step 1).

Distributed (``distributed`` keyword; docs/strategy-api.md, "Distributed modes"): the reference
is always the mean over ranks of each rank's fp32 gradient — the quantity the averaged
mixed-precision gradient estimates — so every rank computes the same ratio and scale. Under DDP
the probe all-reduces the reference gradients and MAX-reduces both sums (the closure runs the plain
module, not the DDP wrapper); over a ZeRO partition (``"sharded"``, plain tensors) each rank sums
the averaged reference over the parameters its optimizers hold, and the sums are SUM-reduced; on
FSDP-managed parameters the reference is FSDP's own backward (the closure calls the FSDP-wrapped
model; :mod:`strategies.probe_sharded`). Which steps probe is the host's update count, the same on
every rank (:mod:`strategies.agreement` checks it).

P: the ``params`` given to :meth:`set_reference` (tensors, or ``(name, tensor)`` pairs such as
``model.named_parameters()``), else the parameters of the model given to :meth:`attach`, else
those of the first optimizer unscaled in the probe step; restricted by ``probe_layers`` (fnmatch
patterns over parameter or module names, e.g. ``["encoder.0.*", "head"]``) to cut the cost
(unnamed tensors are named through the attached model). With
gradient accumulation the closure must return the loss of everything accumulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.params import ScalerParams, hp
from strategies.probe import PROBE_STATE, ProbeRule, ReferenceProbe, ratio_probe_
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["NormRatioParams", "NormRatioStrategy", "norm_ratio_update_"]


def norm_ratio_update_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    log_ratio_ema: torch.Tensor,
    ema_steps: torch.Tensor,
    last_ratio: torch.Tensor,
    found_inf: torch.Tensor,
    ref_sumsq: torch.Tensor,
    mp_sumsq: torch.Tensor,
    probed: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    threshold_high: float,
    threshold_low: float,
    ema_decay: float,
) -> None:
    """The norm-ratio rule, in place on the device (no host sync). Scalar tensors.

    Args:
        scale: float32 S; growth_tracker: int32 (torch's semantics).
        log_ratio_ema: float32 m, the EMA of log2 r; ema_steps: int32 count of valid probes.
        last_ratio: float32, written with this probe's raw r (untouched when not ``probed``).
        found_inf: float32, > 0 when the step's gradients were non-finite.
        ref_sumsq, mp_sumsq: float32 sums of squares of the fp32 reference gradient and of the
            unscaled mixed-precision gradient over the probed parameters (ignored unless
            ``probed``).
        probed: whether this step carries a probe (a host bool: the probe schedule is host-side).
        other arguments: the hyper-parameters (see the module docstring).
    """
    if not probed:
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return
    s_native, t_native = scale.clone(), growth_tracker.clone()
    torch._amp_update_scale_(s_native, t_native, found_inf, growth_factor, backoff_factor, growth_interval)
    acted, moved = ratio_probe_(scale, log_ratio_ema, ema_steps, last_ratio, found_inf, ref_sumsq, mp_sumsq, None,
                                growth_factor, backoff_factor, threshold_high, threshold_low, ema_decay)
    scale.copy_(torch.where(acted, moved, s_native))
    growth_tracker.copy_(torch.where(acted, torch.zeros_like(t_native), t_native))


@dataclass
class NormRatioParams(ProbeRule, ScalerParams):
    ema_decay: float = hp(0.5, v.between(0.0, 1.0, "[)"), "scalelab", "geometric EMA of the ratio across probes")


@register_strategy("norm_ratio")
class NormRatioStrategy(ReferenceProbe, Strategy):
    """Norm-ratio scaling: every ``probe_interval`` steps compare ``||g_fp32||`` with the
    unscaled mixed-precision ``||g_mp / S||`` and double / halve S past the thresholds; backoff/
    growth (torch's rule) in between (seed 003, section 3.2; full rule in the module docstring).
    Give the reference with :meth:`set_reference` (the probe: :mod:`strategies.probe`)."""

    Params = NormRatioParams
    state_spec = (
        State("log_ratio_ema", torch.float32, 0.0),
        State("ema_steps", torch.int32, 0, low=0),
        *PROBE_STATE,
    )
    probe_fallback = "backoff/growth (native)"

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        probed, ref, mp = self.probe_sums()
        self.run_update("norm_ratio_update_", norm_ratio_update_, last_ratio=self.state.norm_ratio,
                        found_inf=found_inf, ref_sumsq=ref, mp_sumsq=mp, probed=probed)
