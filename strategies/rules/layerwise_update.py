"""The per-group update of ``layerwise`` (rules ``max_ema`` and ``backoff_growth``; the strategy,
its groups and boundaries: :mod:`strategies.rules.layerwise`): the Python twin of
``torch.ops.scalelab.layerwise_update_``, with the overflow attribution of
:func:`strategies.layer_groups.overflow_origin`.
"""

from __future__ import annotations

import torch

from strategies.formats import round_down_pow2
from strategies.layer_groups import overflow_origin
from strategies.rules.max_ema import max_ema_update_
from strategies.rules.native import native_update_

__all__ = ["RULES", "layerwise_update_"]

RULES = ("max_ema", "backoff_growth", "adaloss")
"""Per-group rules. ``adaloss`` (strategies/rules/adaloss.py) updates through its own op, ``adaloss_step_``
(CPU twin and CUDA kernel, ``cuda/include/rules/adaloss.h``); the other two through
``layerwise_update_``."""


def layerwise_update_(
    scales: torch.Tensor,
    growth_trackers: torch.Tensor,
    ema: torch.Tensor,
    ema_steps: torch.Tensor,
    hysteresis: torch.Tensor,
    candidate: torch.Tensor,
    origin: torch.Tensor,
    found_inf: torch.Tensor,
    group_found_inf: torch.Tensor,
    group_absmax: torch.Tensor,
    group_numel: torch.Tensor,
    emitted: torch.Tensor,
    contaminated: torch.Tensor,
    rule: str,
    target_max: float,
    ema_decay: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    grow_on_zero: bool,
    min_scale: float | None,
    max_scale: float | None,
    cap_ema_on_overflow: bool = False,
) -> None:
    """The per-group rule, in place on the device (no host sync). Every tensor has shape [G]
    except ``found_inf`` (scalar: > 0 when any gradient of the step was non-finite).

    Args:
        scales (float32), growth_trackers (int32), ema (float32), ema_steps (int32),
            hysteresis (int32, ``backoff_growth``'s tracker, H = 1): the per-group state; updated.
        candidate: float32, written with each group's ``target_max / absmax`` (``max_ema``).
        origin: float32, written with 1.0 for the groups blamed for this step's overflow.
        group_found_inf, group_absmax, group_numel: the step's per-group statistics.
        emitted, contaminated: float32, > 0 where a boundary hook saw a non-finite gradient
            leave the group downward / arrive into it from above.
        rule: ``"max_ema"`` or ``"backoff_growth"``; other arguments: hyper-parameters;
            ``min_scale``/``max_scale`` are the power-of-two bounds (None: unbounded).

    Origin = (own gradients non-finite or emitted non-finite) and not contaminated, on a
    skipped step; if no group qualifies, every group. Origin groups run the rule with
    found_inf = 1 (back off, EMA not fed). Groups that are not origins on a skipped step, and
    groups that received no gradient, keep their state; every tracker restarts on a skipped step.
    New scales are rounded down to powers of two and clamped.
    """
    skip = found_inf != 0
    blamed = overflow_origin(found_inf, group_found_inf, emitted, contaminated)
    frozen = (skip & ~blamed) | (group_numel == 0)
    old = [t.clone() for t in (scales, growth_trackers, ema, ema_steps, hysteresis)]
    if rule == "max_ema":
        max_ema_update_(scales, ema, ema_steps, growth_trackers, candidate, blamed.float(), group_absmax,
                        target_max, ema_decay, growth_factor, backoff_factor, growth_interval, True, grow_on_zero,
                        cap_ema_on_overflow)
    elif rule == "backoff_growth":
        native_update_(scales, growth_trackers, hysteresis, blamed.float(),
                       growth_factor, backoff_factor, growth_interval, 1)
        scales.copy_(round_down_pow2(scales))
    else:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    for t, o in zip((scales, growth_trackers, ema, ema_steps, hysteresis), old):
        t.copy_(torch.where(frozen, o, t))
    growth_trackers.copy_(torch.where(skip, torch.zeros_like(growth_trackers), growth_trackers))
    if min_scale is not None or max_scale is not None:
        scales.clamp_(min=min_scale, max=max_scale)
    origin.copy_(blamed.float())
