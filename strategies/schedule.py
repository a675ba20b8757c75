"""Statistics every k steps (seed 003 §4.2: "update every N steps instead of every step") and of
a share of the layers (§4.1: "sample the statistics of key layers"): the ``stats_every`` and
``stats_layers`` options of every rule that reads gradient statistics.

``stats_layers = q`` (0 < q <= 1) reads the statistics of :func:`sampled` ``q`` of the gradient
tensors (in the optimizer's order; attached rules: of the layer boundaries), evenly spread from
the first; the others are unscaled and checked for Inf/NaN by torch's found-inf pass, so an
overflow anywhere still skips the step. The rule then sees the abs-max, norm and counts of the
sample. Per-group rules (``layerwise``) need every group's statistics and refuse ``q < 1``;
sharded gradients (FSDP, ``distributed`` modes other than replicated) are read whole.

With ``stats_every = k`` a rule reads its statistics on **statistic steps** only — the updates
numbered ``0, k, 2k, ...`` (:attr:`strategies.base.Strategy.updates` before the update) — and
runs its own update function there, exactly as with ``k = 1`` (bit for bit: ``k = 1`` makes every
step one). On the steps in between it **holds**:

* the overflow check still runs every step (torch's found-inf pass, or the per-group pass that a
  per-group rule needs to unscale anyway), so a step with an Inf or NaN is still skipped;
* a clean step leaves the scale and all the rule's state (EMAs, histories, trackers) as they
  are: the rule's clock runs in statistic steps, so the rule with ``k`` sees the sequence of
  statistic steps as a rule with ``k = 1`` would see a run of those steps alone
  (tests/strategies/test_stats_every.py);
* an overflow multiplies the scale by ``backoff_factor`` and restarts the growth tracker
  (:func:`hold_update_`, torch's backoff); a per-group rule backs off only the groups the overflow
  is attributed to (``layerwise``'s ``hold_``).

What is saved: the statistics pass (fused kernel) becomes torch's found-inf-only unscale on hold
steps; attach-based rules skip their boundary statistics (``underflow_target``'s exponent
histograms, AdaLoss's gradient and weight statistics); the rule's update op does not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strategies import validation as v
from strategies.params import hp

__all__ = ["StatsSchedule", "hold_update_", "pass_options", "reads_stats", "run_rule", "sampled", "stats_step"]


def _share(field: str, value: Any) -> float:
    """A share in (0, 1]."""
    x = v.finite_positive(field, value)
    if x > 1.0:
        v.fail(field, "in (0, 1]", value)
    return x


def sampled(n: int, share: float) -> list[int]:
    """``max(1, round(n * share))`` of the indices ``0 .. n-1``, evenly spread from index 0 (the
    input side of a model's layers, where gradients underflow first); all of them at share 1."""
    k = min(n, max(1, round(n * share)))
    return sorted({(i * n) // k for i in range(k)})


@dataclass
class StatsSchedule:
    """The ``stats_every`` option (a params mixin of the rules that read statistics)."""

    stats_every: int = hp(1, v.integer(1), "seed 003 §4.2",
                          "read the statistics every k-th update, hold in between (overflow is checked every step)")
    stats_layers: float = hp(1.0, _share, "seed 003 §4.1",
                             "share of the gradient tensors (attached: of the layer boundaries) whose statistics are read")


def stats_step(strategy: Any) -> bool:
    """Is the coming update a statistic step (``updates % stats_every == 0``)? Host-side."""
    return strategy.updates % getattr(strategy.params, "stats_every", 1) == 0


def pass_options(strategy: Any) -> dict[str, Any]:
    """The statistics options of this step's pass over the gradients (:func:`strategies.gather.gather`):
    ``with_stats`` (:func:`reads_stats`) and ``sample``, the ``stats_layers`` share."""
    return {"with_stats": reads_stats(strategy), "sample": getattr(strategy.params, "stats_layers", 1.0)}


def reads_stats(strategy: Any) -> bool:
    """Does this step's pass over the gradients gather statistics: the rule needs them (or
    ``track_stats``) and it is a statistic step; a per-group rule always runs its grouped pass
    (it unscales each group by its own scale)."""
    wanted = strategy.needs_stats or strategy.params.track_stats
    return wanted and (strategy.per_group or stats_step(strategy))


def hold_update_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                 backoff_factor: float) -> None:
    """A hold step, in place, no host sync: on an overflow ``S <- S * backoff_factor`` and the
    growth tracker restarts; a clean step changes nothing."""
    skip = found_inf.reshape(()) != 0
    scale.copy_(torch.where(skip, scale * backoff_factor, scale))
    growth_tracker.copy_(torch.where(skip, torch.zeros_like(growth_tracker), growth_tracker))


def run_rule(strategy: Any, found_inf: torch.Tensor, stats: Any) -> None:
    """The rule's ``update_`` on a statistic step, else its ``hold_`` (default
    :func:`hold_update_`)."""
    if stats_step(strategy):
        strategy.update_(found_inf, stats)
    elif hasattr(strategy, "hold_"):
        strategy.hold_(found_inf, stats)
    else:
        s = strategy.state
        hold_update_(s.scale, s.growth_tracker, found_inf, strategy.params.backoff_factor)
