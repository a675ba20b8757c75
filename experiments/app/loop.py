"""The training loop: :func:`run`, from a composed config to a finished run directory.

Shape (karpathy/nanoGPT ``train.py``, torchtitan's ``Trainer``): a typed config
(:class:`experiments.app.config.RunConfig`), the run directory's one resume decision
(:meth:`experiments.app.rundir.RunDir.resume_plan`), the objects it builds
(:class:`experiments.app.step.Parts`), the step read whole
(:func:`experiments.app.step.train_step`: forward, scaled backward, ``unscale_``, the regime's
rescaling, clipping, ``step``, ``update``), and the loop around it (:func:`_train`,
:func:`_steps`): train lines, evaluations, stops and checkpoints, recorded by
:class:`experiments.app.recorder.Recorder`, which owns the run record, the loggers, the counters
and the checkpoints.

Telemetry is read from the device only on logging steps (every ``train.log_every``). A divergence,
a collapsed scale or a forward overflow stops the run as ``diverged`` or ``stalled``; an exception
ends it as ``failed`` (``requeued`` when submitit requeues the job, ``experiments/app/preemption.py``),
then re-raised (``experiments/app/stops.py``). A stalled or diverged run is diagnosed by the doctor
(``experiments/doctor/diagnosis.py``) before the final summary is written. Checkpoints every
``train.checkpoint_every`` steps and at the end; re-running in the same directory with the same
configuration resumes from the checkpoint (``experiments/app/rundir.py``).
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from experiments import schema
from experiments.app import checkpoint as ckpt
from experiments.app import distributed as dist, fidelity, preemption, recipe, stops, telemetry, tracefile
from experiments.app.build import AppError, ConfigError, one_line, build_data, build_model, build_optimizer, build_precision
from experiments.app.build import build_strategy, run_labels
from experiments.app.config import RunConfig
from experiments.app.log_lines import RunProgress
from experiments.app.recorder import Recorder, say
from experiments.app.rl_step import check as check_rl, frozen_copy, rl_step
from experiments.app.rundir import RunDir
from experiments.app.step import BatchLoss, Parts, StepResult, train_step
from experiments.doctor import diagnosis
from experiments.workloads.precision import BoundaryHooks

__all__ = ["run"]


TEXT_KINDS = ("text", "rl")
"""Data kinds whose evaluation is language modelling (metric: bits per character)."""


def _evaluate(model: torch.nn.Module, data: Any, precision: Any, device: torch.device, n_batches: int) -> dict:
    """Mean validation loss and the workload metric (bits per char for text, accuracy otherwise);
    the rl workload adds ``eval_reward``, the mean reward of its fixed evaluation prompts sampled in
    the run's precision (:meth:`experiments.workloads.rl_task.PolicyTask.eval_reward`)."""
    model.eval()
    total, count, correct = 0.0, 0, 0
    with torch.no_grad(), precision.autocast_context(device):
        for x, y in data.eval_batches(n_batches):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = recipe.loss(logits, y)
            n = y.numel()
            total += loss.item() * n
            count += n
            correct += int((logits.argmax(-1) == y).sum().item())
    model.train()
    eval_loss = total / max(count, 1)
    metric = eval_loss / math.log(2) if data.kind in TEXT_KINDS else correct / max(count, 1)
    out = {"eval_loss": eval_loss, "eval_metric": metric}
    if callable(getattr(data, "eval_reward", None)):
        out["eval_reward"] = data.eval_reward(model, partial(precision.autocast_context, device), device)
    return out


def run(cfg: DictConfig, out_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), choices: dict | None = None) -> dict:
    """Train as ``cfg`` says, writing the run record under ``out_dir``; return the summary.
    ``choices``: the config-group options chosen (Hydra's ``runtime.choices``), for the record's labels.

    Raises:
        ConfigError: a bad option, or a directory holding another run (before anything is written).
        AppError: an unusable checkpoint, or a directory another process is writing.
        Exception: whatever training raised, after recording ``status: failed``.
    """
    run_cfg = RunConfig.from_hydra(cfg)
    precision = build_precision(cfg)
    try:
        info = dist.setup(device=run_cfg.device)
    except ValueError as exc:
        raise ConfigError(one_line(exc)) from None
    try:
        rundir = RunDir(Path(dist.broadcast_object(str(Path(out_dir).resolve()), info)))
        if info.is_main:
            rundir.prepare()
            rundir.lock()
        try:
            return _resume_and_train(cfg, run_cfg, rundir, list(overrides), info, precision, choices)
        finally:
            rundir.release()
    finally:
        dist.cleanup()


def _resume_and_train(cfg: DictConfig, run_cfg: RunConfig, rundir: RunDir, overrides: list[str],
                      info: dist.DistInfo, precision: Any, choices: dict | None) -> dict:
    """Act on the directory's one resume decision (:meth:`RunDir.resume_plan`): refuse (its one-line
    error), return the summary of a run already finished here, or build (from the checkpoint when
    resuming) and train."""
    tcfg = run_cfg.train
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    plan = rundir.resume_plan(resolved, tcfg.resume, tcfg.steps).check()
    if plan.action == "finished":  # re-running it changes nothing
        say(f"{rundir.path} already {plan.status} at step {plan.step}")
        return plan.summary

    prev_det, prev_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    if tcfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if run_cfg.threads is not None:
        torch.set_num_threads(run_cfg.threads)
    try:
        names = run_labels(cfg, choices)
        parts = _build(cfg, run_cfg, info, precision, plan.state, rundir.path)
        rec = Recorder(run_cfg, rundir, resolved, overrides, names, info.device, info.is_main, plan)
        rec.open(cfg.logger)
        parts.trace = tracefile.start(rec, parts, run_cfg, names)
        return _train(run_cfg, parts, rec, names)
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def _build(cfg: DictConfig, run_cfg: RunConfig, info: dist.DistInfo, precision: Any, state: dict | None,
           out_dir: Path) -> Parts:
    """Data, model, optimizer, strategy and boundary hooks, from the checkpoint ``state`` when
    resuming. Model initialisation depends on the seed only; the dropout RNG is per rank."""
    data = build_data(cfg)
    dist.seed_everything(run_cfg.seed)
    raw_model = build_model(cfg, data).to(info.device)
    reference = None
    if data.kind == "rl":  # the frozen initial policy, copied before any hook is attached
        check_rl(data, run_cfg)
        reference = frozen_copy(raw_model)
    model = dist.wrap_model(raw_model, info, run_cfg.distributed.mode)
    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params)
    strategy = build_strategy(cfg)
    dist.seed_everything(run_cfg.seed, info, per_rank=True)
    hooks = BoundaryHooks(raw_model, precision, run_cfg.seed)
    try:
        if callable(getattr(strategy, "attach", None)):
            strategy.attach(raw_model)
    except ValueError as exc:
        hooks.remove()
        raise ConfigError(f"strategy: {one_line(exc)}") from None
    clock = telemetry.OptimizerClock(optimizer)
    lr_for = run_cfg.train.lr_schedule(optimizer.param_groups[0]["lr"])  # the base rate, before a resumed state
    if state is not None:
        try:
            dist.load_full_state(raw_model, optimizer, state["model"], state["optimizer"])
            strategy.load_state_dict(state["strategy"])
            ckpt.restore_rng(state["rng"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            hooks.remove()
            raise AppError(
                f"checkpoint {out_dir / schema.CHECKPOINT_NAME} does not match this configuration "
                f"({one_line(exc)[:300]}); use another hydra.run.dir or the configuration it was written with"
            ) from None
    batch: dict[str, Any] = {}
    if callable(getattr(strategy, "set_reference", None)):
        strategy.set_reference(BatchLoss(raw_model, batch, hooks), params)
    return Parts(data, raw_model, model, params, optimizer, strategy, hooks, clock, lr_for, batch, info, precision,
                 fidelity.layer_of(raw_model), reference)




@dataclass
class _Position:
    """Where the loop is: the step running (or last run), the last evaluated step, and how the run
    ends (``running`` until a stop, then ``stops``' status and one-line error)."""

    step: int
    last_eval: int = -1
    status: str = "running"
    error: str | None = None


def _train(run_cfg: RunConfig, parts: Parts, rec: Recorder, names: dict[str, str]) -> dict:
    """The steps from ``rec.start_step + 1`` to ``train.steps`` (:func:`_steps`), then the final
    evaluation and checkpoint; however the run ends, the one final summary (:func:`_finish`)."""
    tcfg, info = run_cfg.train, parts.info
    at = _Position(step=rec.start_step)
    progress = RunProgress(tcfg.progress and info.is_main, tcfg.steps, rec.start_step, names["strategy"])
    watch = preemption.RequeueWatch()
    exit_code = 1
    try:
        _steps(run_cfg, parts, rec, names, at, progress)
        if at.status == "running":
            if at.last_eval != at.step:
                ev = _evaluate(parts.model, parts.data, parts.precision, info.device, tcfg.eval_batches)
                rec.eval_line(at.step, ev)
                at.status, at.error = stops.eval_loss(ev["eval_loss"], at.step) or (at.status, at.error)
            if at.status == "running":
                at.status = "completed"
        rec.checkpoint(at.step, at.status, parts.raw_model, parts.optimizer, parts.strategy)
        exit_code = 0
    except BaseException as exc:
        at.status, at.error = stops.exception(exc, watch.signal_name, at.step, rec.saved_at)
        raise
    finally:
        watch.close()
        progress.close()
        summary = _finish(parts, rec, at, exit_code)
    return summary


def _steps(run_cfg: RunConfig, parts: Parts, rec: Recorder, names: dict[str, str], at: _Position,
           progress: RunProgress) -> None:
    """Each step (:func:`experiments.app.step.train_step`), then its records (fidelity, train and
    eval lines, counters), the stops (ending the loop with ``at.status``), the checkpoint due and
    the kill aid."""
    tcfg, hooks = run_cfg.train, parts.hooks
    fid_every = tcfg.fidelity_every if parts.info.world_size == 1 else 0  # single process only
    step_fn = rl_step if parts.data.kind == "rl" else train_step  # GRPO: rollouts, then update passes
    parts.model.train()
    for step in range(rec.start_step + 1, tcfg.steps + 1):
        at.step = step
        log_now = tcfg.log_step(step)
        hooks.measure, hooks.hist = log_now, tcfg.histogram_step(step)
        if log_now:
            hooks.reset()
        done = step_fn(parts, run_cfg, step, measure=log_now, probe=bool(fid_every) and step % fid_every == 0,
                       first=step == rec.start_step + 1)
        if parts.trace is not None:  # the step's trace row (its loss before any regime multiplier), on the device
            parts.trace.stepped(step, done.loss, parts.optimizer.param_groups[0]["lr"])
        if done.probed is not None:
            rec.fidelity(step, done.probed, fidelity.seconds(done.probed))
        rec.count(step, done.loss, done.skipped, done.step_time, done.strategy_time)
        if log_now and (stop := _train_line(run_cfg, parts, rec, names, step, done, progress)) is not None:
            at.status, at.error = stop
            return
        hooks.measure = False
        if tcfg.eval_every and step % tcfg.eval_every == 0:
            ev = _evaluate(parts.model, parts.data, parts.precision, parts.info.device, tcfg.eval_batches)
            rec.eval_line(step, ev)
            at.last_eval = step
            if (stop := stops.eval_loss(ev["eval_loss"], step)) is not None:
                at.status, at.error = stop
                return
        if tcfg.max_consecutive_skips and rec.counters["consecutive_skips"] >= tcfg.max_consecutive_skips:
            at.status, at.error = stops.skipped_in_a_row(float(done.loss.detach()), step, tcfg.max_consecutive_skips,
                                                         float(parts.strategy.get_scale()), names["precision"], parts.batch)
            return  # (one read, at the stop)
        if tcfg.checkpoint_step(step):
            rec.checkpoint(step, "running", parts.raw_model, parts.optimizer, parts.strategy)
        progress.advance()
        if tcfg.kill_at_step is not None and step == tcfg.kill_at_step:
            # Testing aid: die as a SIGKILL would, without any cleanup.
            rec.close()
            os.kill(os.getpid(), signal.SIGKILL)


def _train_line(run_cfg: RunConfig, parts: Parts, rec: Recorder, names: dict[str, str], step: int, done: StepResult,
                progress: RunProgress) -> stops.Stop | None:
    """The train line of logging step ``step`` (the strategy's telemetry and the hooks' activation
    statistics read here), and the stop its loss calls for."""
    row = rec.train_line(step, done.loss, done.skipped, parts.strategy, done.grad_stats, parts.hooks.read(),
                         float(parts.optimizer.param_groups[0]["lr"]), done.step_time, done.strategy_time, done.extra)
    progress.logged(step, row)
    return stops.logged_loss(row["loss"], step, rec.counters["skipped_steps"], run_cfg.train.divergence_loss,
                             names["precision"], parts.batch)


def _finish(parts: Parts, rec: Recorder, at: _Position, exit_code: int) -> dict:
    """The one place the final summary is written (completed, diverged, stalled, requeued or failed):
    close the record and the hooks; a stalled, diverged or scale-floor run gets the doctor's
    diagnosis (``diagnosis.json``, never raises), whose verdict ends the summary's one-line error
    and whose cause is the summary's ``diagnosis``."""
    rec.close()
    parts.hooks.remove()
    if callable(getattr(parts.strategy, "detach", None)):
        parts.strategy.detach()
    # the doctor re-runs the model on rank 0 alone: not on FSDP2 shards (their forward needs every rank)
    alone = parts.info.is_main and not dist.is_sharded(parts.raw_model)
    diag = diagnosis.diagnose_run(rec.rundir.path, parts.raw_model, recipe.loss, parts.batch, parts.precision,
                                  parts.strategy, parts.lr_for, at.step, at.status, at.error) if alone else None
    summary = rec.summary(at.status, diagnosis.annotate(at.status, at.error, diag))
    if diag is not None:
        summary["diagnosis"] = diag.cause
    rec.finish(summary, exit_code)
    return summary
