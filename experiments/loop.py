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

Telemetry (strategy tensors, per-layer activation-gradient statistics) is read from the device
only on logging steps (every ``train.log_every``). Divergence (a logged loss that is non-finite or
above ``train.divergence_loss``) stops the run with status ``diverged``; an exception is recorded
as ``failed`` and re-raised. Checkpoints every ``train.checkpoint_every`` steps and at the end;
re-running in the same directory resumes from the checkpoint.
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
from experiments import distributed as dist
from experiments import records
from experiments.build import (
    AppError,
    ConfigError,
    build_data,
    build_model,
    build_optimizer,
    build_precision,
    build_strategy,
    strategy_label,
    validate,
)
from experiments.data import step_generator
from experiments.precision import BoundaryHooks

__all__ = ["run"]

FP16_SMALLEST_NORMAL = 2.0**-14


def _loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (LM) or example (classifier), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _param_grad_stats(params: list[torch.nn.Parameter]) -> dict[str, float]:
    """abs-max, L2 norm, zero and fp16-subnormal fractions of the parameter gradients (one sync)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return {"grad_absmax": 0.0, "grad_norm": 0.0, "grad_zero_frac": 1.0, "grad_subnormal_frac": 0.0}
    absmax = torch.stack([g.abs().max().float() for g in grads]).max()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    zeros = sum((g == 0).sum() for g in grads)
    sub = sum(((g != 0) & (g.abs() < FP16_SMALLEST_NORMAL)).sum() for g in grads)
    numel = sum(g.numel() for g in grads)
    a, n, z, s = torch.stack([absmax, norm, zeros.float(), sub.float()]).tolist()  # type: ignore[union-attr]
    return {"grad_absmax": a, "grad_norm": n, "grad_zero_frac": z / numel, "grad_subnormal_frac": s / numel}


def _read_telemetry(strategy: Any) -> dict[str, Any]:
    """The strategy's telemetry as Python numbers (the logging-step sync)."""
    if not callable(getattr(strategy, "telemetry", None)):
        return {"scale": float(strategy.get_scale()) if strategy.is_enabled() else 1.0}
    out: dict[str, Any] = {}
    for key, value in strategy.telemetry().items():
        if isinstance(value, torch.Tensor):
            out[key] = value.item() if value.numel() == 1 and key != "scales" else value.tolist()
        else:
            out[key] = value
    return out


class _OptimizerClock:
    """Optimizer step hooks: time spent inside ``optimizer.step`` and whether it ran this step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.elapsed = 0.0
        self.ran = False
        self._t0 = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.elapsed += time.perf_counter() - self._t0
        self.ran = True

    def reset(self) -> None:
        self.elapsed, self.ran = 0.0, False


def _names(cfg: DictConfig) -> dict[str, str]:
    names = {
        "strategy": strategy_label(cfg),
        "precision": str(cfg.precision.name),
        "model": str(cfg.model.get("name", "model")),
        "data": str(cfg.data.get("name", "data")),
        "regime": str(cfg.regime.get("name", "plain")),
    }
    names["workload"] = f"{names['model']}/{names['data']}/{names['regime']}"
    return names


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


def run(cfg: DictConfig, out_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Train as ``cfg`` says, writing the run record under ``out_dir``; return the summary.

    Raises:
        ConfigError: a bad option (before anything is written).
        AppError: an unusable checkpoint in ``out_dir`` (nothing is overwritten).
        Exception: whatever training raised, after recording ``status: failed``.
    """
    validate(cfg)
    precision = build_precision(cfg)
    try:
        info = dist.setup(device=str(cfg.device))
    except ValueError as exc:
        raise ConfigError(" ".join(str(exc).split())) from None
    try:
        return _resume_and_train(cfg, out_dir, list(overrides), info, precision)
    finally:
        dist.cleanup()


def _resume_and_train(
    cfg: DictConfig, out_dir: str | Path, overrides: list[str], info: dist.DistInfo, precision: Any
) -> dict:
    """Load the checkpoint (if any) before touching ``out_dir``, then train."""
    out_dir = Path(dist.broadcast_object(str(Path(out_dir).resolve()), info))
    tcfg = cfg.train
    ckpt_path = out_dir / ckpt.CHECKPOINT_NAME
    state = None
    if tcfg.get("resume", True) and ckpt_path.exists():
        try:
            state = ckpt.load(ckpt_path)
        except ckpt.CheckpointError as exc:
            raise AppError(str(exc)) from None
        finished = state.get("status") == "diverged" or (
            state.get("status") == "completed" and state["step"] >= int(tcfg.steps)
        )
        if finished:
            # Re-running a finished run changes nothing (raise train.steps to continue a completed one).
            print(f"scalelab-train: {out_dir} already {state['status']} at step {state['step']}", file=sys.stderr)
            return records.read_json(out_dir / records.SUMMARY_NAME)

    prev_det, prev_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    if tcfg.get("deterministic", False):
        torch.use_deterministic_algorithms(True)
    if cfg.get("threads") is not None:
        torch.set_num_threads(int(cfg.threads))
    try:
        return _train(cfg, out_dir, overrides, info, precision, _names(cfg), state)
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def _train(
    cfg: DictConfig,
    out_dir: Path,
    overrides: list[str],
    info: dist.DistInfo,
    precision: Any,
    names: dict[str, str],
    state: dict | None,
) -> dict:
    tcfg, rcfg = cfg.train, cfg.regime
    device = info.device
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
    hooks = BoundaryHooks(raw_model, precision)
    if callable(getattr(strategy, "attach", None)):
        strategy.attach(raw_model)
    clock = _OptimizerClock(optimizer)

    counters = {"steps": 0, "skipped_steps": 0, "timed_steps": 0, "step_time_sum": 0.0, "strategy_time_sum": 0.0}
    start_step = 0
    if state is not None:
        try:
            raw_model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            strategy.load_state_dict(state["strategy"])
            ckpt.restore_rng(state["rng"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            reason = " ".join(str(exc).split())[:300]
            raise AppError(
                f"checkpoint {out_dir / ckpt.CHECKPOINT_NAME} does not match this configuration ({reason}); "
                "use another hydra.run.dir or the configuration it was written with"
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

    # Records (rank 0 only). Truncate metrics to the checkpoint so the resumed record has no duplicates.
    main = info.is_main
    metrics_path = out_dir / records.METRICS_NAME
    summary_path = out_dir / records.SUMMARY_NAME
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    head = {"status": "running", "error": None, **names, "seed": seed, "sweep": str(cfg.sweep)}
    fingerprint = records.fingerprint(resolved, overrides, str(device))
    writer = records.MetricsWriter(None)
    wandb_logger = None
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        records.truncate_metrics(metrics_path, start_step)
        records.write_json_atomic(summary_path, {**head, "steps": start_step, "diverged": False, "fingerprint": fingerprint})
        writer = records.MetricsWriter(metrics_path)
        lcfg = OmegaConf.to_container(cfg.logger, resolve=True)
        assert isinstance(lcfg, dict)
        if lcfg.get("name") == "wandb":
            lcfg["mode"] = os.environ.get("WANDB_MODE") or lcfg.get("mode")  # W&B's own variable wins
        if lcfg.get("name") == "wandb" and lcfg["mode"] != "disabled":
            tags = [names["precision"], names["model"], names["data"], names["regime"], names["strategy"]]
            wandb_logger = records.WandbLogger(
                out_dir,
                lcfg,
                resolved,
                group=str(cfg.sweep),
                job_type=names["strategy"],
                tags=tags + list(lcfg.get("tags") or []) + list(cfg.get("tags") or []),
                name=f"{names['strategy']}-{names['precision']}-{names['workload']}-s{seed}",
            )

    def emit(row: dict) -> None:
        writer.write(row)
        if wandb_logger is not None:
            wandb_logger.log(row)

    def save_checkpoint(step: int, status: str) -> None:
        if main and int(tcfg.checkpoint_every) > 0:
            ckpt.save(
                out_dir / ckpt.CHECKPOINT_NAME,
                {
                    "step": step,
                    "status": status,
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "strategy": strategy.state_dict(),
                    "rng": ckpt.capture_rng(),
                    "data_position": step,
                    "counters": dict(counters),
                    "loss_window": (loss_sum.detach().cpu().clone(), loss_count),
                },
            )

    steps = int(tcfg.steps)
    log_every, hist_every = int(tcfg.log_every), int(tcfg.hist_every)
    eval_every, ckpt_every = int(tcfg.eval_every), int(tcfg.checkpoint_every)
    warmup = int(tcfg.warmup)
    kill_at = tcfg.get("kill_at_step")
    status, error = "running", None
    last_eval_step = -1
    loss_sum = torch.zeros((), device=device)
    loss_count = 0
    if state is not None:
        loss_sum += state["loss_window"][0].to(device)
        loss_count = int(state["loss_window"][1])
    show = bool(tcfg.get("progress", True)) and main and sys.stderr.isatty()
    bar = tqdm(total=steps, initial=start_step, disable=not show, desc=names["strategy"], dynamic_ncols=True)
    step = start_step
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
            clock.reset()
            t0 = time.perf_counter()
            with precision.autocast_context(device):
                logits = model(batch["x"])
            loss = _loss_fn(logits, batch["y"])
            ts = time.perf_counter()
            scaled = strategy.scale(loss * m if m != 1.0 else loss)
            t_strat = time.perf_counter() - ts
            scaled.backward()
            ts = time.perf_counter()
            strategy.unscale_(optimizer)
            t_strat += time.perf_counter() - ts
            own_stats = _param_grad_stats(params) if log_now else None
            if rescale and multiplier != 1.0:
                grads = [p.grad for p in params if p.grad is not None]
                torch._foreach_div_(grads, multiplier)
            if float(tcfg.grad_clip) > 0:
                torch.nn.utils.clip_grad_norm_(params, float(tcfg.grad_clip))
            ts = time.perf_counter()
            strategy.step(optimizer)
            strategy.update()
            t_strat += time.perf_counter() - ts - clock.elapsed
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            loss_count += 1
            step_time = time.perf_counter() - t0
            skipped = not clock.ran
            counters["steps"] = step
            counters["skipped_steps"] += int(skipped)
            if step > warmup:
                counters["timed_steps"] += 1
                counters["step_time_sum"] += step_time
                counters["strategy_time_sum"] += t_strat

            if log_now:
                loss_val, loss_avg = torch.stack([loss.detach().float(), loss_sum / loss_count]).tolist()
                loss_sum.zero_()
                loss_count = 0
                tel = _read_telemetry(strategy)
                row: dict[str, Any] = {"kind": "train", "step": step, "loss": loss_val, "loss_avg": loss_avg}
                row["scale"] = float(tel.get("scale", 1.0)) if strategy.is_enabled() else 1.0
                if "scales" in tel and isinstance(tel["scales"], list):
                    row["scales"] = [float(v) for v in tel["scales"]]
                    row["scale_groups"] = list(getattr(strategy, "group_names", []))
                row["skipped"] = skipped
                row["skipped_total"] = counters["skipped_steps"]
                use_tel = strategy.is_enabled() and all(
                    k in tel for k in ("grad_absmax", "grad_norm", "grad_zero_frac", "grad_subnormal_frac")
                )
                for key in ("grad_absmax", "grad_norm", "grad_zero_frac", "grad_subnormal_frac"):
                    row[key] = float(tel[key]) if use_tel else own_stats[key]  # type: ignore[index]
                row.update(hooks.read())
                row["lr"] = float(optimizer.param_groups[0]["lr"])
                row["step_time_s"] = step_time
                row["strategy_time_s"] = t_strat
                if "probe_time_s" in tel:
                    row["probe_time_s"] = float(tel["probe_time_s"])
                emit(row)
                bar.set_postfix(loss=f"{loss_val:.3f}", scale=f"{row['scale']:.3g}", refresh=False)
                if not math.isfinite(loss_val) or loss_val > float(tcfg.divergence_loss):
                    status = "diverged"
                    error = f"training loss {loss_val} at step {step} is non-finite or above train.divergence_loss={tcfg.divergence_loss}"
                    break
            hooks.measure = False

            if eval_every and step % eval_every == 0:
                ev = _evaluate(model, data, precision, device, int(tcfg.eval_batches))
                emit({"kind": "eval", "step": step, **ev})
                last_eval_step = step
                if not math.isfinite(ev["eval_loss"]):
                    status, error = "diverged", f"eval loss is non-finite at step {step}"
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
                emit({"kind": "eval", "step": step, **ev})
                if not math.isfinite(ev["eval_loss"]):
                    status, error = "diverged", f"eval loss is non-finite at step {step}"
            if status == "running":
                status = "completed"
        save_checkpoint(step, status)
    except BaseException as exc:
        bar.close()
        writer.close()
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        summary = _summary(head, "failed", message, fingerprint, metrics_path, counters)
        if main:
            records.write_json_atomic(summary_path, summary)
            if wandb_logger is not None:
                wandb_logger.finish(summary, exit_code=1)
        hooks.remove()
        raise
    bar.close()
    writer.close()
    hooks.remove()
    summary = _summary(head, status, error, fingerprint, metrics_path, counters)
    if main:
        records.write_json_atomic(summary_path, summary)
        if wandb_logger is not None:
            wandb_logger.finish(summary, exit_code=0)
    return summary


def _summary(head: dict, status: str, error: str | None, fingerprint: dict, metrics_path: Path, counters: dict) -> dict:
    rows = records.read_metrics(metrics_path) if metrics_path.exists() else []
    return {
        **head,
        "status": status,
        "error": error,
        **records.summarize(rows, counters),
        "diverged": status == "diverged",
        "fingerprint": fingerprint,
    }
