"""``replay(trace, strategy)``: what a rule would have done on a recorded run, through its own update.

For each recorded step, in order: the scale(s) the replayed strategy holds now are the scale(s)
the step runs at; the overflow model (:mod:`strategies.tracing.inputs`) says whether the step
overflows at them; the step's :class:`strategies.stats.GradStats` are rebuilt from the trace
(what ``unscale_`` would have gathered) and the inputs the strategy's hooks observe are filled in
(``underflow_target``'s histogram); then the strategy's own :meth:`strategies.Strategy.update`
runs — the same code, the same ``<rule>_update_`` (or its kernel) as in training. No rule is
re-implemented here. A rule's fault (``on_min_scale: raise``) stops the replay where training
would have stopped.

What a replay cannot know: after the first step where the replayed rule skips differently from the
recorded run, the real run's weights (hence its gradients) would differ from the recorded ones;
``docs/replay.md`` measures how far past that point the prediction stays useful. The gradient
entries lost are estimated from the activation-gradient histograms (sparse: at the steps they were
measured).
"""

from __future__ import annotations


import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from strategies.base import Strategy
from strategies.registry import create
from strategies.state import ScaleFloorError, raise_fault
from strategies.tracing.inputs import (OVERFLOW_MODELS, MissingInput, check_inputs, group_overflow, lost_fractions,
                                       shifted_histogram, step_stats)
from strategies.tracing.trace import Trace

__all__ = ["MissingInput", "ReplayResult", "ReplayStep", "replay"]


@dataclass
class ReplayStep:
    """One replayed step: the (loss-side) scale it ran at, per-group scales of per-layer rules,
    whether it is skipped, and at histogram steps the fractions of nonzero activation-gradient
    entries flushed to zero (``lost_frac``) and left subnormal at that scale."""

    step: int
    scale: float
    skipped: bool
    scales: list[float] | None = None
    lost_frac: float | None = None
    subnormal_frac: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ReplayResult:
    """A replay's trajectory and what it comes to (see :func:`replay`)."""

    strategy: str
    steps: list[ReplayStep] = field(default_factory=list)
    groups: list[str] | None = None
    stopped: tuple[int, str] | None = None
    floor: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def skipped_steps(self) -> list[int]:
        return [s.step for s in self.steps if s.skipped]

    @property
    def min_scale(self) -> tuple[float, int] | None:
        """The lowest scale reached and the first step that ran at it."""
        if not self.steps:
            return None
        low = min(s.scale for s in self.steps)
        return low, next(s.step for s in self.steps if s.scale == low)

    @property
    def floor_step(self) -> int | None:
        """The first step that ran at the strategy's ``min_scale`` (None: never, or no floor)."""
        if self.floor is None:
            return None
        return next((s.step for s in self.steps if s.scale <= self.floor), None)

    def lost_frac_mean(self) -> float | None:
        vals = [s.lost_frac for s in self.steps if s.lost_frac is not None]
        return sum(vals) / len(vals) if vals else None

    def summary(self) -> dict[str, Any]:
        """The numbers a table row needs."""
        low = self.min_scale
        return {"strategy": self.strategy, "steps": len(self.steps), "skipped": len(self.skipped_steps),
                "skipped_steps": self.skipped_steps[:50], "final_scale": self.steps[-1].scale if self.steps else None,
                "min_scale": low[0] if low else None, "min_scale_step": low[1] if low else None,
                "floor": self.floor, "floor_step": self.floor_step, "lost_frac_mean": self.lost_frac_mean(),
                "stopped_step": self.stopped[0] if self.stopped else None,
                "stopped": self.stopped[1] if self.stopped else None, "notes": list(self.notes)}


class _StandIn(nn.Module):
    """A module with one child per layer group of the trace (``g0``, ``g1``, ...): what a per-layer
    strategy attaches to so that it holds the trace's groups. Nothing runs through it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.add_module(f"g{i}", nn.Linear(1, 1))


def _prepare(strategy: Strategy, trace: Trace, device: torch.device) -> None:
    """Attach what holds the trace's groups (per-layer rules) or stands for observed layers
    (histogram rules), and initialise the state as the first ``scale()`` does."""
    if strategy.per_group or type(strategy).attach is not Strategy.attach:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy.attach(_StandIn(len(trace.groups) if strategy.per_group else 1))
    strategy.scale(torch.zeros((), device=device))


def _feed(strategy: Strategy, found: torch.Tensor, stats: Any, contaminated: list[bool]) -> None:
    """Leave what ``unscale_`` would have left (found_inf and statistics, one optimizer), then run
    the strategy's own ``update()``."""
    state = strategy.state
    if strategy.per_group and "contaminated" in state.specs:
        state.contaminated.copy_(torch.tensor([float(c) for c in contaminated], device=state.scale.device))
    opt_state = strategy._per_optimizer_states[0]
    opt_state.update(stage=OptState.STEPPED, found_inf_per_device={found.device: found}, stats=stats)
    strategy.update()


def _fault(strategy: Strategy) -> str | None:
    """The one-line message of a fault the last update recorded (``on_min_scale: raise``)."""
    state = strategy.state
    if "fault" not in state.specs or int(state.fault) == 0:
        return None
    try:
        raise_fault(strategy, int(state.fault))
    except ScaleFloorError as exc:
        return str(exc)
    return None


def replay(trace: Trace, strategy: Strategy | str, *, overflow: str = "auto",
           device: str | torch.device = "cpu") -> ReplayResult:
    """Run ``strategy`` (a fresh, unused :class:`Strategy`, or a registered rule's name with its
    defaults) on ``trace`` and return its trajectory (module docstring; the overflow model
    ``overflow``: ``auto`` | ``persist`` | ``bound``, :mod:`strategies.tracing.inputs`).

    Raises:
        MissingInput: the strategy reads what the trace does not record (e.g. ``norm_ratio``'s fp32
            probe), or is disabled.
    """
    if overflow not in OVERFLOW_MODELS:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODELS)}, got {overflow!r}")
    device = torch.device(device)
    if isinstance(strategy, str):
        strategy = create(strategy, str(device.type))
    notes = check_inputs(strategy, trace)
    if strategy.state is not None:
        raise ValueError(f"{strategy.name}: replay needs a fresh strategy (this one has already scaled)")
    _prepare(strategy, trace, device)
    floor = strategy.params.min_scale
    result = ReplayResult(strategy.name, groups=list(trace.groups) if strategy.per_group else None,
                          floor=None if floor is None else float(floor), notes=notes)
    index = {step: i for i, step in enumerate(trace.steps)}
    clean = [h for h in sorted(trace.histograms) if h in index and not trace.found_inf[index[h]]]
    for i, step in enumerate(trace.steps):
        scales = strategy.state.scale.reshape(-1).tolist()
        over, feed = group_overflow(trace, i, scales, overflow)
        found, stats, contaminated = step_stats(trace, i, over, feed, strategy.per_group, device)
        out = ReplayStep(step, float(strategy.output_scale()), bool(found), scales if strategy.per_group else None)
        if step in trace.histograms:
            ratio = out.scale / trace.scale[i][-1]
            out.lost_frac, out.subnormal_frac = lost_fractions(trace.histograms[step], ratio, trace)
        held = _held_histogram(clean, step)  # an overflowed backward's histogram stands for no other step
        if held is not None and any(spec.name == "exp_hist" for spec in strategy._specs()):
            ratio = out.scale / trace.scale[index[held]][-1]
            strategy.state.exp_hist.copy_(shifted_histogram(trace.histograms[held], ratio, trace, device))
        result.steps.append(out)
        _feed(strategy, found, stats, contaminated)
        message = _fault(strategy)
        if message is not None:
            result.stopped = (step, message)
            break
    return result


def _held_histogram(hist_steps: list[int], step: int) -> int | None:
    """The histogram step that stands for ``step``: the last (of a clean step) at or before it, else the first."""
    if not hist_steps:
        return None
    before = [h for h in hist_steps if h <= step]
    return before[-1] if before else hist_steps[0]


