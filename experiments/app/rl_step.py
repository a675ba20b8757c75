"""One step of the ``rl`` workload, read whole: :func:`rl_step` — GRPO on the pretrained policy.

The task (:class:`experiments.workloads.rl_task.PolicyTask`, ``parts.data``) gives the rollouts and
the loss; this step puts them on the loop's clock. Every ``passes`` steps a new rollout batch is
sampled from the policy in the run's precision (its forward under the precision's autocast: fp16
for an fp16 run, the sampler's precision of arXiv 2510.26788), prompts and samples drawn from
:func:`experiments.workloads.data.step_generator` of ``(seed, step)``, so a run is a function of its
seed; each step is then one update pass on that batch:

1. the step's learning rate; the GRPO loss (PPO's clipped surrogate, + the KL term when
   ``data.kl_coef > 0``) of the batch under the current policy, forward in the precision's autocast;
2. the scaler's calls exactly as :func:`experiments.app.step.train_step` makes them
   (:func:`experiments.app.step.scaled_update`: ``scale``, ``backward``, ``unscale_``, statistics,
   the fidelity probe — whose loss is this step's RL loss, recomputed in fp32 at the same weights
   on the same batch —, clipping, ``step``, ``update``), so the strategy sees the same contract.

One optimizer step per loop step: ``train.steps`` counts updates, as the growth interval does,
and a skipped step is one skipped update. On a logging step the record gets the rollout batch's
mean ``reward`` and ``kl_ref``, the exact per-token ``KL(pi || pi_ref)`` to the initial policy
on that batch (fp32, no gradient). A resumed run starts with a new rollout: checkpoints fall on
rollout boundaries (``train.checkpoint_every`` a multiple of ``data.passes``, :func:`check`).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch

from experiments.app import fidelity, recipe
from experiments.app.build import ConfigError
from experiments.app.config import RunConfig
from experiments.app.step import Parts, StepResult, StepTimer, scaled_update
from experiments.workloads.data import step_generator

__all__ = ["RolloutLoss", "check", "frozen_copy", "rl_step"]


class RolloutLoss:
    """``task.loss(model, rollout)`` of the current rollout batch: the loss the scaled backward of
    an rl step differentiates, recomputed by the fidelity probe in fp32."""

    def __init__(self, task: Any, model: torch.nn.Module, batch: dict[str, Any]) -> None:
        self.task, self.model, self.batch = task, model, batch

    def __call__(self) -> torch.Tensor:
        return self.task.loss(self.model, self.batch["rollout"])


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy: a copy of ``model`` (made before any hook is attached), in eval mode,
    without gradients."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def check(task: Any, run: RunConfig) -> None:
    """Raise :class:`ConfigError` unless checkpoints fall on rollout boundaries (module docstring)."""
    every = run.train.checkpoint_every
    if every and every % task.passes:
        raise ConfigError(f"train.checkpoint_every must be a multiple of data.passes={task.passes} for the rl "
                          f"workload (a resumed run starts with a new rollout), got {every}")


def rl_step(parts: Parts, run: RunConfig, step: int, measure: bool, probe: bool, first: bool) -> StepResult:
    """Step ``step`` as the module docstring says (arguments as :func:`experiments.app.step.train_step`'s)."""
    p, task, device = parts, parts.data, parts.info.device
    autocast = partial(p.precision.autocast_context, device)  # the sampler's precision
    if (step - 1) % task.passes == 0 or "rollout" not in p.batch:
        was_training = p.raw_model.training
        p.raw_model.eval()
        rollout = task.rollout(p.raw_model, step_generator(run.seed, step), autocast, p.reference, device)
        p.raw_model.train(was_training)
        tokens = rollout.tokens
        p.batch.update(rollout=rollout, x=tokens[:, :-1], y=tokens[:, 1:], m=1.0)  # x, y: for the doctor
    recipe.set_lr(p.optimizer, p.lr_for(step))
    p.clock.reset()
    rng = fidelity.capture_rng(device) if probe else None
    timer = StepTimer(p.strategy, p.clock)
    with autocast():
        loss = task.loss(p.model, p.batch["rollout"])
    grad_stats, probed, strategy_time = scaled_update(
        p, run, loss, timer, measure, first, None if rng is None else (RolloutLoss(task, p.raw_model, p.batch), rng))
    p.optimizer.zero_grad(set_to_none=True)
    probe_time = 0.0 if probed is None else fidelity.seconds(probed)
    wall = timer.wall_seconds() - probe_time
    extra: dict[str, float] = {}
    if measure:  # a logging step's reads, after the step's timing
        rollout = p.batch["rollout"]
        extra["reward"] = float(rollout.rewards.mean())
        if p.reference is not None:
            extra["kl_ref"] = float(task.kl_to(p.raw_model, p.reference, rollout))
    return StepResult(loss.detach(), not p.clock.ran, grad_stats, probed, wall, strategy_time, extra)
