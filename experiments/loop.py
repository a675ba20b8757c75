"""The training loop: one function, :func:`run`, from a composed config to a finished run directory.

Per step (nanoGPT-style plain code, the GradScaler recipe of seed 001/002):

1. batch for ``(seed, step)``; forward under the precision's autocast; ``loss`` (reported);
2. ``strategy.scale(loss * m)`` then ``backward()``, where ``m = regime.loss_multiplier`` (times
   ``regime.spike_factor`` on ``regime.spike_steps``) — the stress that shrinks (or spikes) every
   gradient flowing through the low-precision backward;
3. ``strategy.unscale_(optimizer)``; then, when ``regime.rescale_grads``, the fp32 parameter
   gradients are divided by ``loss_multiplier`` so the optimizer sees the true gradient and the
   regime only changes what the low-precision backward had to represent (spikes stay spikes);
4. optional clipping, ``strategy.step(optimizer)`` (skips on non-finite gradients),
   ``strategy.update()``.

Telemetry (strategy tensors, per-layer activation-gradient statistics) is read from the device only
on logging steps (every ``train.log_every``) and flattened generically
(``experiments/telemetry.py``). A divergence, a collapsed scale or a forward overflow stops the run
as ``diverged`` or ``stalled``; an exception ends it as ``failed`` (``requeued`` when submitit
requeues the job), then re-raised (``experiments/stops.py``). Checkpoints every
``train.checkpoint_every`` steps and at the end; re-running in the same directory with the same
configuration resumes from the checkpoint (``experiments/rundir.py`` says what a run directory
guarantees). Records go through ``experiments/records.py``, mirrors through the configured loggers.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments import checkpoint as ckpt
from experiments import diagnosis, distributed as dist, fidelity, preemption, recipe, records, schema, stops, telemetry
from experiments.build import (
    AppError,
    ConfigError,
    one_line,
    build_data,
    build_model,
    build_optimizer,
    build_precision,
    build_strategy,
    run_labels,
    validate,
)
from experiments.data import step_generator
from experiments.loggers import RunInfo, instantiate_loggers
from experiments.precision import BoundaryHooks
from experiments.rundir import RunDir

__all__ = ["run"]

def _loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (LM) or example (classifier), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _evaluate(model: torch.nn.Module, data: Any, precision: Any, device: torch.device, n_batches: int) -> dict:
    """Mean validation loss and the workload metric (bits per char for text, accuracy otherwise)."""
    model.eval()
    total, count, correct = 0.0, 0, 0
    with torch.no_grad(), precision.autocast_context(device):
        for x, y in data.eval_batches(n_batches):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = _loss_fn(logits, y)
            n = y.numel()
            total += loss.item() * n
            count += n
            correct += int((logits.argmax(-1) == y).sum().item())
    model.train()
    eval_loss = total / max(count, 1)
    metric = eval_loss / math.log(2) if data.kind == "text" else correct / max(count, 1)
    return {"eval_loss": eval_loss, "eval_metric": metric}


def _say(message: str) -> None:
    print(f"scalelab-train: {message}", file=sys.stderr)


def run(cfg: DictConfig, out_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), choices: dict | None = None) -> dict:
    """Train as ``cfg`` says, writing the run record under ``out_dir``; return the summary.
    ``choices``: the config-group options chosen (Hydra's ``runtime.choices``), for the record's labels.

    Raises:
        ConfigError: a bad option, or a directory holding another run (before anything is written).
        AppError: an unusable checkpoint, or a directory another process is writing.
        Exception: whatever training raised, after recording ``status: failed``.
    """
    validate(cfg)
    precision = build_precision(cfg)
    try:
        info = dist.setup(device=str(cfg.device))
    except ValueError as exc:
        raise ConfigError(one_line(exc)) from None
    try:
        rundir = RunDir(Path(dist.broadcast_object(str(Path(out_dir).resolve()), info)))
        if info.is_main:
            rundir.prepare()
            rundir.lock()
        try:
            return _resume_and_train(cfg, rundir, list(overrides), info, precision, choices)
        finally:
            rundir.release()
    finally:
        dist.cleanup()


def _resume_and_train(
    cfg: DictConfig, rundir: RunDir, overrides: list[str], info: dist.DistInfo, precision: Any, choices: dict | None
) -> dict:
    """Check the directory holds this run (or none), load its checkpoint, then train."""
    tcfg = cfg.train
    resume = bool(tcfg.get("resume", True))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    state = rundir.resume_state(resolved, resume)
    if (last := rundir.finished_record(state, resume, int(tcfg.steps))) is not None:  # re-running it changes nothing
        _say(f"{rundir.path} already {last.get('status')} at step {last.get('step', last.get('steps'))}")
        return records.read_json(rundir.path / schema.SUMMARY_NAME)

    prev_det, prev_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    if tcfg.get("deterministic", False):
        torch.use_deterministic_algorithms(True)
    if cfg.get("threads") is not None:
        torch.set_num_threads(int(cfg.threads))
    try:
        return _train(cfg, rundir, overrides, info, precision, state, resolved, run_labels(cfg, choices))
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def _train(
    cfg: DictConfig,
    rundir: RunDir,
    overrides: list[str],
    info: dist.DistInfo,
    precision: Any,
    state: dict | None,
    resolved: dict,
    names: dict[str, str],
) -> dict:
    tcfg, rcfg = cfg.train, cfg.regime
    device, main, out_dir = info.device, info.is_main, rundir.path
    seed = int(cfg.seed)

    # Build: model initialisation depends on the seed only; dropout RNG per rank.
    data = build_data(cfg)
    dist.seed_everything(seed)
    raw_model = build_model(cfg, data).to(device)
    model = dist.wrap_model(raw_model, info)
    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params)
    strategy = build_strategy(cfg)
    dist.seed_everything(seed, info, per_rank=True)
    hooks = BoundaryHooks(raw_model, precision, seed)
    try:
        if callable(getattr(strategy, "attach", None)):
            strategy.attach(raw_model)
    except ValueError as exc:
        hooks.remove()
        raise ConfigError(f"strategy: {one_line(exc)}") from None
    clock = telemetry.OptimizerClock(optimizer)
    lr_for = recipe.schedule(tcfg, optimizer.param_groups[0]["lr"])  # the base rate, before a resumed state

    counters = {"steps": 0, "skipped_steps": 0, "consecutive_skips": 0, "timed_steps": 0,
                "step_time_sum": 0.0, "strategy_time_sum": 0.0}
    start_step = 0
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
        counters.update(state["counters"])
        start_step = int(state["step"])

    multiplier = float(rcfg.loss_multiplier)
    spike_steps = set(rcfg.spike_steps)
    spike_factor = float(rcfg.spike_factor)
    rescale = bool(rcfg.get("rescale_grads", True))
    batch: dict[str, Any] = {}  # the current step's inputs, targets and loss multiplier

    if callable(getattr(strategy, "set_reference", None)):

        def reference_loss() -> torch.Tensor:
            """The same batch's loss (times the regime multiplier) in fp32: no autocast, no fp8."""
            with hooks.disabled():
                return _loss_fn(raw_model(batch["x"]), batch["y"]) * batch["m"]

        strategy.set_reference(reference_loss, params)

    # Records (rank 0 only): a start at step 0 moves any earlier record aside (replaced-<n>/), a
    # resume truncates the metrics to the checkpoint (no duplicates, no malformed lines).
    metrics_path, summary_path = out_dir / schema.METRICS_NAME, out_dir / schema.SUMMARY_NAME
    head = {**names, "seed": seed, "sweep": str(cfg.sweep)}
    fingerprint = records.fingerprint(resolved, overrides, str(device))
    writer = records.MetricsWriter(None)
    loggers: list = []

    def make_summary(status: str, error: str | None) -> dict:
        rows = records.read_metrics(metrics_path)  # every rank: rank 0's record (shared file system)
        return {"status": status, "error": error, **head, **records.summarize(rows, counters),
                "diverged": status == "diverged", "fingerprint": fingerprint}

    if main:
        if state is None and rundir.has_record():  # nothing a new start would overwrite is lost
            why = "train.resume=false" if not tcfg.get("resume", True) else "no checkpoint to resume from"
            _say(f"{why}: {out_dir} starts at step 0; its earlier records are now in {rundir.move_aside()}")
        later, malformed = records.truncate_metrics(metrics_path, start_step)
        if later or malformed:
            _say(f"resuming {out_dir} at step {start_step}: dropped {later} line(s) of {schema.METRICS_NAME} "
                 f"after that step and {malformed} malformed line(s)")
        tags = [names["precision"], names["model"], names["data"], names["regime"], names["strategy"]]
        loggers = instantiate_loggers(cfg.logger, RunInfo(
            run_dir=out_dir, run_id=rundir.run_id(), config=resolved, group=str(cfg.sweep),
            job_type=names["strategy"], tags=tags + [str(t) for t in cfg.get("tags") or []],
            name=f"{names['strategy']}-{names['precision']}-{names['workload']}-s{seed}",
        ))
        records.write_summary(summary_path, make_summary("running", None))
        writer = records.MetricsWriter(metrics_path)

    def emit(row: dict) -> None:
        writer.write(row)
        for logger in loggers:
            logger.log(row)

    saved_at = start_step  # the step a restart resumes from

    def save_checkpoint(step: int, status: str) -> None:
        nonlocal saved_at
        if main and int(tcfg.checkpoint_every) > 0:
            ckpt.save(
                out_dir / schema.CHECKPOINT_NAME,
                {"step": step, "status": status, "config": records.redact(resolved),
                 "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                 "strategy": strategy.state_dict(), "rng": ckpt.capture_rng(), "data_position": step,
                 "counters": dict(counters), "loss_window": (loss_sum.detach().cpu().clone(), loss_count)},
            )
            saved_at = step

    steps = int(tcfg.steps)
    log_every, hist_every = int(tcfg.log_every), int(tcfg.hist_every)
    eval_every, ckpt_every = int(tcfg.eval_every), int(tcfg.checkpoint_every)
    warmup, max_skips = int(tcfg.warmup), int(tcfg.get("max_consecutive_skips", 0))
    fid_every = int(tcfg.get("fidelity_every", 0)) if info.world_size == 1 else 0  # single process only
    fid_layers = fidelity.layer_of(raw_model)
    kill_at = tcfg.get("kill_at_step")
    status, error, exit_code = "running", None, 1
    last_eval_step = -1
    loss_sum = torch.zeros((), device=device)
    loss_count = 0
    if state is not None:
        loss_sum += state["loss_window"][0].to(device)
        loss_count = int(state["loss_window"][1])
    show = bool(tcfg.get("progress", True)) and main and sys.stderr.isatty()
    bar = tqdm(total=steps, initial=start_step, disable=not show, desc=names["strategy"], dynamic_ncols=True)
    step = start_step
    watch = preemption.RequeueWatch()
    try:
        model.train()
        for step in range(start_step + 1, steps + 1):
            log_now = step % log_every == 0 or step == steps
            hooks.measure = log_now
            # The histogram goes on the first logging step at or after each multiple of hist_every.
            prev_log = ((step - 1) // log_every) * log_every
            hooks.hist = log_now and hist_every > 0 and step // hist_every > prev_log // hist_every
            if log_now:
                hooks.reset()
            m = multiplier * (spike_factor if step in spike_steps else 1.0)
            x, y = dist.shard_batch(data.batch(int(tcfg.batch_size), step_generator(seed, step)), info)
            batch.update(x=x.to(device), y=y.to(device), m=m)
            recipe.set_lr(optimizer, lr_for(step))
            clock.reset()
            rng = fidelity.capture_rng(device) if fid_every and step % fid_every == 0 else None
            t0, hooks0 = time.perf_counter(), getattr(strategy, "hook_seconds", 0.0)  # attached rules' hooks
            with precision.autocast_context(device):
                logits = model(batch["x"])
            loss = _loss_fn(logits, batch["y"])
            try:
                ts = time.perf_counter()
                scaled = strategy.scale(loss * m if m != 1.0 else loss)
                t_strat = time.perf_counter() - ts
                scaled.backward()
                ts = time.perf_counter()
                strategy.unscale_(optimizer)
                t_strat += time.perf_counter() - ts
                own_stats = telemetry.param_grad_stats(params) if log_now else {}
                probed = None if rng is None else fidelity.probe(  # the same loss as the scaled backward
                    raw_model, lambda: _loss_fn(raw_model(batch["x"]), batch["y"]) * batch["m"], params, rng, fid_layers)
                if rescale and multiplier != 1.0:
                    grads = [p.grad for p in params if p.grad is not None]
                    torch._foreach_div_(grads, multiplier)
                if float(tcfg.grad_clip) > 0:
                    torch.nn.utils.clip_grad_norm_(params, float(tcfg.grad_clip))
                ts = time.perf_counter()
                strategy.step(optimizer)
                strategy.update()
                t_strat += time.perf_counter() - ts - clock.elapsed + getattr(strategy, "hook_seconds", 0.0) - hooks0
            except ValueError as exc:
                if step > start_step + 1:
                    raise
                # A strategy option that only shows at first use (e.g. a pattern matching nothing).
                raise ConfigError(f"strategy: {one_line(exc)}") from None
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            loss_count += 1
            step_time = time.perf_counter() - t0
            if probed is not None:  # kept out of step time and strategy overhead
                seconds = fidelity.seconds(probed)
                step_time -= seconds
                counters["fidelity_time_s"] = counters.get("fidelity_time_s", 0.0) + seconds
                emit({"kind": schema.KIND_FIDELITY, "step": step, **probed})
            skipped = not clock.ran
            counters["steps"] = step
            counters["skipped_steps"] += int(skipped)
            counters["consecutive_skips"] = counters.get("consecutive_skips", 0) + 1 if skipped else 0
            if step > warmup:
                counters["timed_steps"] += 1
                counters["step_time_sum"] += step_time
                counters["strategy_time_sum"] += t_strat

            if log_now:
                loss_val, loss_avg = torch.stack([loss.detach().float(), loss_sum / loss_count]).tolist()
                loss_sum.zero_()
                loss_count = 0
                row: dict[str, Any] = {"kind": schema.KIND_TRAIN, "step": step}
                row.update(telemetry.flatten(telemetry.read(strategy), strategy.group_names, own_stats))
                row.update(loss=loss_val, loss_avg=loss_avg, skipped=skipped, skipped_total=counters["skipped_steps"])
                row.update(hooks.read())
                row.update(lr=float(optimizer.param_groups[0]["lr"]), step_time_s=step_time, strategy_time_s=t_strat)
                emit(row)
                bar.set_postfix(loss=f"{loss_val:.3f}", scale=f"{row['scale']:.3g}", refresh=False)
                if (stop := stops.logged_loss(loss_val, step, counters["skipped_steps"], tcfg.divergence_loss,
                                              names["precision"], batch)) is not None:
                    status, error = stop
                    break
            hooks.measure = False

            if eval_every and step % eval_every == 0:
                ev = _evaluate(model, data, precision, device, int(tcfg.eval_batches))
                emit({"kind": schema.KIND_EVAL, "step": step, **ev})
                last_eval_step = step
                if (stop := stops.eval_loss(ev["eval_loss"], step)) is not None:
                    status, error = stop
                    break
            if max_skips and counters["consecutive_skips"] >= max_skips:
                status, error = stops.skipped_in_a_row(float(loss.detach()), step, max_skips,  # one read, at the stop
                                                       float(strategy.get_scale()), names["precision"], batch)
                break
            if ckpt_every and step % ckpt_every == 0 and step < steps:
                save_checkpoint(step, "running")
            bar.update(1)
            if kill_at is not None and step == int(kill_at):
                # Testing aid: die as a SIGKILL would, without any cleanup.
                writer.close()
                os.kill(os.getpid(), signal.SIGKILL)

        if status == "running":
            if last_eval_step != step:
                ev = _evaluate(model, data, precision, device, int(tcfg.eval_batches))
                emit({"kind": schema.KIND_EVAL, "step": step, **ev})
                status, error = stops.eval_loss(ev["eval_loss"], step) or (status, error)
            if status == "running":
                status = "completed"
        save_checkpoint(step, status)
        exit_code = 0
    except BaseException as exc:
        status, error = stops.exception(exc, watch.signal_name, step, saved_at)
        raise
    finally:
        # The one place the final summary is written (completed, diverged, stalled, requeued or failed).
        watch.close()
        bar.close()
        writer.close()
        hooks.remove()
        if callable(getattr(strategy, "detach", None)):
            strategy.detach()
        summary = make_summary(status, error)
        if main:  # a stalled, diverged or scale-floor run: why, in diagnosis.json (never raises)
            diagnosis.diagnose_run(out_dir, raw_model, _loss_fn, batch, precision, strategy, lr_for, step, status, error)
            records.write_summary(summary_path, summary)
            for logger in loggers:
                logger.finish(summary, exit_code=exit_code)
    return summary
