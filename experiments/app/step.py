"""One training step, read whole: :func:`train_step` (the GradScaler recipe of seed 001/002, in
the shape of torchtitan's ``forward_backward_step`` and nanoGPT's step).

1. batch for ``(seed, step)`` (this rank's shard); the step's learning rate; forward under the
   precision's autocast; ``loss`` (fp32 cross-entropy, reported);
2. ``strategy.scale(loss * m)`` then ``backward()``, where ``m = regime.loss_multiplier`` (times
   ``regime.spike_factor`` on ``regime.spike_steps``) — the stress that shrinks (or spikes) every
   gradient flowing through the low-precision backward;
3. ``strategy.unscale_(optimizer)``; then, when ``regime.rescale_grads``, the fp32 parameter
   gradients are divided by ``loss_multiplier`` so the optimizer sees the true gradient and the
   regime only changes what the low-precision backward had to represent (spikes stay spikes);
4. optional clipping (``train.grad_clip``), ``strategy.step(optimizer)`` (skips on non-finite
   gradients), ``strategy.update()``.

Steps 2-4 are :func:`scaled_update`, the scaler's calls, which the rl workload's step
(:func:`experiments.app.rl_step.rl_step`: a rollout, then update passes) makes exactly alike.

On a logging step the loop's own gradient statistics are read after ``unscale_``
(:func:`experiments.app.telemetry.param_grad_stats`); on a fidelity step the unscaled gradient is
compared with the fp32 one at the same weights, batch and dropout (:mod:`experiments.app.fidelity`),
before the regime's rescaling. :class:`StepTimer` keeps the step's wall time and the part of it
spent inside the strategy; nothing in the step reads the device but GradScaler's own skip decision.
With ``parts.trace`` (a :class:`strategies.tracing.TraceRecorder`), :func:`scaled_update` records the
per-group abs-max after ``unscale_`` and the loop then leaves the step's row of the statistics trace
on the device (read at the logging interval: ``experiments/app/tracefile.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from experiments.app import distributed as dist, fidelity, recipe, telemetry
from experiments.app.build import ConfigError, one_line
from experiments.app.config import RunConfig
from experiments.workloads.data import step_generator
from experiments.workloads.precision import BoundaryHooks

__all__ = ["BatchLoss", "Parts", "StepResult", "StepTimer", "scaled_update", "train_step"]


class BatchLoss:
    """``loss_fn(model(x), y) * m`` of the current step's ``batch = {"x", "y", "m"}``: the loss the
    scaled backward differentiates, for the fidelity probe; with ``hooks``, computed with the
    boundary hooks off (no autocast, no fp8): the fp32 reference a strategy such as norm-ratio
    compares with (``strategy.set_reference``)."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, Any], hooks: BoundaryHooks | None = None) -> None:
        self.model, self.batch, self.hooks = model, batch, hooks

    def __call__(self) -> torch.Tensor:
        if self.hooks is None:
            return recipe.loss(self.model(self.batch["x"]), self.batch["y"]) * self.batch["m"]
        with self.hooks.disabled():
            return recipe.loss(self.model(self.batch["x"]), self.batch["y"]) * self.batch["m"]


@dataclass
class Parts:
    """What a run trains with. ``model`` is ``raw_model`` wrapped for DDP (the same object on one
    process); ``batch`` is the current step's inputs, targets and loss multiplier (the rl workload:
    also its rollout batch); ``layers`` names each parameter's layer (``id(p) -> name``, for the
    fidelity probe); ``reference`` is the frozen initial policy of the rl workload (else ``None``)."""

    data: Any
    raw_model: torch.nn.Module
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    strategy: Any
    hooks: BoundaryHooks
    clock: telemetry.OptimizerClock
    lr_for: Callable[[int], float]
    batch: dict[str, Any]
    info: dist.DistInfo
    precision: Any
    layers: dict[int, str]
    reference: torch.nn.Module | None = None
    trace: Any = None  # a strategies.tracing.TraceRecorder, fed every step (experiments/app/tracefile.py)


@dataclass(frozen=True)
class StepResult:
    """What one step leaves for the loop's records: the loss (a device tensor, no read), whether
    ``strategy.step`` skipped the optimizer, the gradient statistics of a logging step, the
    fidelity line of a probe step, the step's wall and strategy seconds (probe excluded), and the
    workload's own values of a logging step (``extra``: the rl workload's reward and KL)."""

    loss: torch.Tensor
    skipped: bool
    grad_stats: dict[str, float]
    probed: dict[str, Any] | None
    step_time: float
    strategy_time: float
    extra: dict[str, float] = field(default_factory=dict)


class StepTimer:
    """A step's wall time and the part of it inside the strategy.

    ``strategy_time = (time inside the `with timer:` blocks: scale, unscale_, step and update)
    - (time inside optimizer.step, which strategy.step calls: the optimizer clock)
    + (time the strategy's boundary hooks ran during forward and backward: Strategy.hook_seconds)``.
    """

    def __init__(self, strategy: Any, clock: telemetry.OptimizerClock) -> None:
        self.strategy, self.clock = strategy, clock
        self.start, self.hooks0 = time.perf_counter(), self._hooks()
        self.inside, self._t = 0.0, 0.0

    def _hooks(self) -> float:
        return getattr(self.strategy, "hook_seconds", 0.0)

    def __enter__(self) -> StepTimer:
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inside += time.perf_counter() - self._t

    def strategy_seconds(self) -> float:
        return self.inside - self.clock.elapsed + self._hooks() - self.hooks0

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.start


def train_step(parts: Parts, run: RunConfig, step: int, measure: bool, probe: bool, first: bool) -> StepResult:
    """Step ``step`` as the module docstring says. ``measure``: a logging step (read the gradient
    statistics); ``probe``: a fidelity step; ``first``: the run's first step, where a strategy's
    ``ValueError`` is a bad option that only shows at first use (a ``ConfigError``)."""
    p, regime = parts, run.regime
    m = regime.multiplier(step)
    x, y = dist.shard_batch(p.data.batch(run.train.batch_size, step_generator(run.seed, step)), p.info)
    p.batch.update(x=x.to(p.info.device), y=y.to(p.info.device), m=m)
    recipe.set_lr(p.optimizer, p.lr_for(step))
    p.clock.reset()
    rng = fidelity.capture_rng(p.info.device) if probe else None  # the probe replays this step's dropout
    timer = StepTimer(p.strategy, p.clock)
    with p.precision.autocast_context(p.info.device):
        logits = p.model(p.batch["x"])
    loss = recipe.loss(logits, p.batch["y"])
    divide = regime.loss_multiplier if regime.rescale_grads else 1.0  # the stress was the backward's only
    grad_stats, probed, strategy_time = scaled_update(p, run, loss * m if m != 1.0 else loss, timer, measure, first,
                                                      None if rng is None else (BatchLoss(p.raw_model, p.batch), rng),
                                                      divide)
    p.optimizer.zero_grad(set_to_none=True)
    probe_time = 0.0 if probed is None else fidelity.seconds(probed)  # kept out of step and strategy time
    return StepResult(loss, not p.clock.ran, grad_stats, probed, timer.wall_seconds() - probe_time, strategy_time)


def scaled_update(p: Parts, run: RunConfig, loss: torch.Tensor, timer: StepTimer, measure: bool, first: bool,
                  probe: tuple[Callable[[], torch.Tensor], Any] | None,
                  divide: float = 1.0) -> tuple[dict[str, float], dict[str, Any] | None, float]:
    """The scaler's calls of every step, GradScaler's recipe: ``strategy.scale(loss)``, ``backward()``,
    ``strategy.unscale_(optimizer)``; then the gradient statistics (``measure``), the fidelity probe
    (``probe = (loss_fn, rng)``: the fp32 gradient of ``loss_fn()`` at these weights against the
    unscaled one), the fp32 gradients divided by ``divide`` (a regime's loss multiplier), clipping
    (``train.grad_clip``), ``strategy.step(optimizer)`` and ``strategy.update()``. Returns
    ``(grad_stats, probed, strategy seconds)``; on the run's ``first`` step a strategy's
    ``ValueError`` is a :class:`ConfigError`."""
    strategy, optimizer = p.strategy, p.optimizer
    try:
        with timer:
            scaled = strategy.scale(loss)
        scaled.backward()
        with timer:
            strategy.unscale_(optimizer)
        if p.trace is not None:
            p.trace.unscaled(p.params)
        grad_stats = telemetry.param_grad_stats(p.params) if measure else {}
        probed = None if probe is None else fidelity.probe(p.raw_model, probe[0], p.params, probe[1], p.layers)
        if divide != 1.0:
            torch._foreach_div_([q.grad for q in p.params if q.grad is not None], divide)
        if run.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(p.params, run.train.grad_clip)
        with timer:
            strategy.step(optimizer)
            strategy.update()
        return grad_stats, probed, timer.strategy_seconds()
    except ValueError as exc:
        if not first:
            raise
        raise ConfigError(f"strategy: {one_line(exc)}") from None  # e.g. a pattern matching nothing
