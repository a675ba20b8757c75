"""The training loop: :func:`run`, from a composed config to a finished run directory.

Shape (karpathy/nanoGPT ``train.py``): a typed config (:class:`experiments.app.config.RunConfig`), the
objects it builds (:class:`Parts`), one function :func:`_train` whose body is the whole step, and a
recorder (:class:`experiments.app.recorder.Recorder`) that owns the run record, the loggers, the
counters and the checkpoints. Per step (the GradScaler recipe of seed 001/002):

1. batch for ``(seed, step)``; forward under the precision's autocast; ``loss`` (reported);
2. ``strategy.scale(loss * m)`` then ``backward()``, where ``m = regime.loss_multiplier`` (times
   ``regime.spike_factor`` on ``regime.spike_steps``) — the stress that shrinks (or spikes) every
   gradient flowing through the low-precision backward;
3. ``strategy.unscale_(optimizer)``; then, when ``regime.rescale_grads``, the fp32 parameter
   gradients are divided by ``loss_multiplier`` so the optimizer sees the true gradient and the
   regime only changes what the low-precision backward had to represent (spikes stay spikes);
4. optional clipping, ``strategy.step(optimizer)`` (skips on non-finite gradients),
   ``strategy.update()``.

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.app import checkpoint as ckpt
from experiments.doctor import diagnosis
from experiments.app import distributed as dist, fidelity, preemption, recipe, records, stops, telemetry
from experiments import schema
from experiments.app.build import AppError, ConfigError, one_line, build_data, build_model, build_optimizer, build_precision
from experiments.app.build import build_strategy, run_labels
from experiments.app.config import RunConfig
from experiments.workloads.data import step_generator
from experiments.workloads.precision import BoundaryHooks
from experiments.app.recorder import Recorder, say
from experiments.app.rundir import RunDir

__all__ = ["run", "Parts", "BatchLoss"]


def _evaluate(model: torch.nn.Module, data: Any, precision: Any, device: torch.device, n_batches: int) -> dict:
    """Mean validation loss and the workload metric (bits per char for text, accuracy otherwise)."""
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
    metric = eval_loss / math.log(2) if data.kind == "text" else correct / max(count, 1)
    return {"eval_loss": eval_loss, "eval_metric": metric}


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
    process); ``batch`` is the current step's inputs, targets and loss multiplier."""

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
    """Check the directory holds this run (or none), load its checkpoint, then train."""
    tcfg = run_cfg.train
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    state = rundir.resume_state(resolved, tcfg.resume)
    if (last := rundir.finished_record(state, tcfg.resume, tcfg.steps)) is not None:  # re-running it changes nothing
        say(f"{rundir.path} already {last.get('status')} at step {last.get('step', last.get('steps'))}")
        return records.read_json(rundir.path / schema.SUMMARY_NAME)

    prev_det, prev_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    if tcfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if run_cfg.threads is not None:
        torch.set_num_threads(run_cfg.threads)
    try:
        names = run_labels(cfg, choices)
        parts = _build(cfg, run_cfg, info, precision, state, rundir.path)
        rec = Recorder(run_cfg, rundir, resolved, overrides, names, info.device, info.is_main, state)
        rec.open(cfg.logger)
        return _train(run_cfg, parts, rec, info, precision, names)
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def _build(cfg: DictConfig, run_cfg: RunConfig, info: dist.DistInfo, precision: Any, state: dict | None,
           out_dir: Path) -> Parts:
    """Data, model, optimizer, strategy and boundary hooks, from ``state`` when resuming. Model
    initialisation depends on the seed only; the dropout RNG is per rank."""
    data = build_data(cfg)
    dist.seed_everything(run_cfg.seed)
    raw_model = build_model(cfg, data).to(info.device)
    model = dist.wrap_model(raw_model, info)
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
            raw_model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
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
    return Parts(data, raw_model, model, params, optimizer, strategy, hooks, clock, lr_for, batch)


def _train(run_cfg: RunConfig, parts: Parts, rec: Recorder, info: dist.DistInfo, precision: Any,
           names: dict[str, str]) -> dict:
    """The steps from ``rec.start_step + 1`` to ``train.steps``, then the final evaluation, checkpoint,
    diagnosis (a stalled or diverged run) and summary; the whole step is this function's loop body."""
    tcfg, regime, device, seed = run_cfg.train, run_cfg.regime, info.device, run_cfg.seed
    data, raw_model, model, params, optimizer = parts.data, parts.raw_model, parts.model, parts.params, parts.optimizer
    strategy, hooks, clock, batch = parts.strategy, parts.hooks, parts.clock, parts.batch
    fid_every = tcfg.fidelity_every if info.world_size == 1 else 0  # single process only
    fid_layers = fidelity.layer_of(raw_model)
    probe_loss = BatchLoss(raw_model, batch)  # the same loss as the scaled backward
    status, error, exit_code = "running", None, 1
    last_eval_step = -1
    show = tcfg.progress and info.is_main and sys.stderr.isatty()
    bar = tqdm(total=tcfg.steps, initial=rec.start_step, disable=not show, desc=names["strategy"], dynamic_ncols=True)
    step = rec.start_step
    watch = preemption.RequeueWatch()
    try:
        model.train()
        for step in range(rec.start_step + 1, tcfg.steps + 1):
            log_now = tcfg.log_step(step)
            hooks.measure, hooks.hist = log_now, tcfg.histogram_step(step)
            if log_now:
                hooks.reset()
            m = regime.multiplier(step)
            x, y = dist.shard_batch(data.batch(tcfg.batch_size, step_generator(seed, step)), info)
            batch.update(x=x.to(device), y=y.to(device), m=m)
            recipe.set_lr(optimizer, parts.lr_for(step))
            clock.reset()
            rng = fidelity.capture_rng(device) if fid_every and step % fid_every == 0 else None
            t0, hooks0 = time.perf_counter(), getattr(strategy, "hook_seconds", 0.0)  # attached rules' hooks
            with precision.autocast_context(device):
                logits = model(batch["x"])
            loss = recipe.loss(logits, batch["y"])
            try:
                ts = time.perf_counter()
                scaled = strategy.scale(loss * m if m != 1.0 else loss)
                t_strat = time.perf_counter() - ts
                scaled.backward()
                ts = time.perf_counter()
                strategy.unscale_(optimizer)
                t_strat += time.perf_counter() - ts
                own_stats = telemetry.param_grad_stats(params) if log_now else {}
                probed = None if rng is None else fidelity.probe(raw_model, probe_loss, params, rng, fid_layers)
                if regime.rescale_grads and regime.loss_multiplier != 1.0:
                    torch._foreach_div_([p.grad for p in params if p.grad is not None], regime.loss_multiplier)
                if tcfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
                ts = time.perf_counter()
                strategy.step(optimizer)
                strategy.update()
                t_strat += time.perf_counter() - ts - clock.elapsed + getattr(strategy, "hook_seconds", 0.0) - hooks0
            except ValueError as exc:
                if step > rec.start_step + 1:
                    raise
                # A strategy option that only shows at first use (e.g. a pattern matching nothing).
                raise ConfigError(f"strategy: {one_line(exc)}") from None
            optimizer.zero_grad(set_to_none=True)
            step_time = time.perf_counter() - t0
            if probed is not None:  # kept out of step time and strategy overhead
                seconds = fidelity.seconds(probed)
                step_time -= seconds
                rec.fidelity(step, probed, seconds)
            skipped = not clock.ran
            rec.count(step, loss, skipped, step_time, t_strat)

            if log_now:
                row = rec.train_line(step, loss, skipped, strategy, own_stats, hooks.read(),
                                     float(optimizer.param_groups[0]["lr"]), step_time, t_strat)
                bar.set_postfix(loss=f"{row['loss']:.3f}", scale=f"{row['scale']:.3g}", refresh=False)
                if (stop := stops.logged_loss(row["loss"], step, rec.counters["skipped_steps"], tcfg.divergence_loss,
                                              names["precision"], batch)) is not None:
                    status, error = stop
                    break
            hooks.measure = False

            if tcfg.eval_every and step % tcfg.eval_every == 0:
                ev = _evaluate(model, data, precision, device, tcfg.eval_batches)
                rec.eval_line(step, ev)
                last_eval_step = step
                if (stop := stops.eval_loss(ev["eval_loss"], step)) is not None:
                    status, error = stop
                    break
            if tcfg.max_consecutive_skips and rec.counters["consecutive_skips"] >= tcfg.max_consecutive_skips:
                status, error = stops.skipped_in_a_row(float(loss.detach()), step, tcfg.max_consecutive_skips,
                                                       float(strategy.get_scale()), names["precision"], batch)
                break  # (one read, at the stop)
            if tcfg.checkpoint_step(step):
                rec.checkpoint(step, "running", raw_model, optimizer, strategy)
            bar.update(1)
            if tcfg.kill_at_step is not None and step == tcfg.kill_at_step:
                # Testing aid: die as a SIGKILL would, without any cleanup.
                rec.close()
                os.kill(os.getpid(), signal.SIGKILL)

        if status == "running":
            if last_eval_step != step:
                ev = _evaluate(model, data, precision, device, tcfg.eval_batches)
                rec.eval_line(step, ev)
                status, error = stops.eval_loss(ev["eval_loss"], step) or (status, error)
            if status == "running":
                status = "completed"
        rec.checkpoint(step, status, raw_model, optimizer, strategy)
        exit_code = 0
    except BaseException as exc:
        status, error = stops.exception(exc, watch.signal_name, step, rec.saved_at)
        raise
    finally:
        # The one place the final summary is written (completed, diverged, stalled, requeued or failed).
        watch.close()
        bar.close()
        rec.close()
        hooks.remove()
        if callable(getattr(strategy, "detach", None)):
            strategy.detach()
        # A stalled, diverged or scale-floor run: why, in diagnosis.json (never raises); its verdict
        # ends the summary's one-line error and its cause is the summary's ``diagnosis``.
        diag = diagnosis.diagnose_run(rec.rundir.path, raw_model, recipe.loss, batch, precision, strategy, parts.lr_for,
                                      step, status, error) if info.is_main else None
        summary = rec.summary(status, diagnosis.annotate(status, error, diag))
        if diag is not None:
            summary["diagnosis"] = diag.cause
        rec.finish(summary, exit_code)
    return summary
