"""Everything a run writes, in one object: :class:`Recorder` owns the run record (``metrics.jsonl``,
``summary.json``), the mirrors (the configured loggers), the step counters and timing sums the
summary is made of, the training-loss window, and the checkpoints (when one is due, what it holds,
the step a restart resumes from).

Rank 0 writes; other ranks keep the counters (their summary is read from rank 0's record on the
shared file system). A start at step 0 in a directory holding an earlier record moves that record
aside (``replaced-<n>/``); a resume truncates ``metrics.jsonl`` to the checkpoint's step (no
duplicates, no malformed lines; ``experiments/app/rundir.py`` says what a run directory guarantees).

Train lines: the strategy's telemetry, read from the device only on logging steps and flattened
generically (``experiments/app/telemetry.py``), then the loss (the step's and the mean since the last
line), the boundary hooks' activation-gradient statistics, the learning rate and the step's wall
times (``step_time_s``; ``strategy_time_s``: time inside the strategy, its hooks included).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from omegaconf import DictConfig

from experiments.app import checkpoint as ckpt
from experiments.app import distributed as dist, records, telemetry
from experiments import schema
from experiments.app.build import instantiate_loggers
from experiments.app.config import RunConfig
from experiments.app.loggers import RunInfo
from experiments.app.rundir import ResumePlan, RunDir

__all__ = ["Recorder", "LossWindow", "say"]


def say(message: str) -> None:
    print(f"scalelab-train: {message}", file=sys.stderr)


class LossWindow:
    """The sum and count of the training losses since the last train line, on the device (no sync
    per step); checkpointed so a resumed run logs the same ``loss_avg``."""

    def __init__(self, device: torch.device, saved: tuple[torch.Tensor, int] | None = None) -> None:
        self.sum = torch.zeros((), device=device)
        self.count = 0
        if saved is not None:
            self.sum += saved[0].to(device)
            self.count = int(saved[1])

    def add(self, loss: torch.Tensor) -> None:
        self.sum += loss.detach()
        self.count += 1

    def read(self, loss: torch.Tensor) -> tuple[float, float]:
        """``(loss, mean loss of the window)`` in one read; the window starts over."""
        loss_val, loss_avg = torch.stack([loss.detach().float(), self.sum / self.count]).tolist()
        self.sum.zero_()
        self.count = 0
        return loss_val, loss_avg

    def state(self) -> tuple[torch.Tensor, int]:
        return self.sum.detach().cpu().clone(), self.count


class Recorder:
    """The run's records, loggers, counters and checkpoints (see the module docstring)."""

    def __init__(self, run: RunConfig, rundir: RunDir, resolved: dict, overrides: list[str],
                 names: dict[str, str], device: torch.device, main: bool, plan: ResumePlan) -> None:
        self.run, self.rundir, self.resolved, self.names, self.main = run, rundir, resolved, names, main
        self.metrics_path, self.summary_path = rundir.path / schema.METRICS_NAME, rundir.path / schema.SUMMARY_NAME
        self.head = {**names, "seed": run.seed, "sweep": run.sweep, "primary": run.regime.primary,
                     **({"cell": run.cell} if run.cell else {})}
        self.fingerprint = records.fingerprint(resolved, overrides, str(device))
        self.counters: dict[str, Any] = {"steps": 0, "skipped_steps": 0, "consecutive_skips": 0, "timed_steps": 0,
                                         "step_time_sum": 0.0, "strategy_time_sum": 0.0}
        state, self.replaces = plan.state, plan.replaces  # the checkpoint when resuming; why records move aside
        self.start_step = 0
        if state is not None:
            self.counters.update(state["counters"])
            self.start_step = int(state["step"])
        self.saved_at = self.start_step  # the step a restart resumes from
        # Which code, torch and host ran which steps (a resume may run on another commit or machine).
        self.segments = records.segments(state, self.fingerprint, run.train.steps,
                                         None if state is None else records.read_json(self.summary_path))
        self.losses = LossWindow(device, None if state is None else state["loss_window"])
        self.writer = records.MetricsWriter(None)
        self.loggers: list = []
        self.trace: Any = None  # the run's TraceFile (experiments/app/tracefile.py), flushed with the records

    def open(self, logger_cfg: DictConfig) -> None:
        """Rank 0: set the directory up for this start or resume (as its :class:`ResumePlan` says),
        start the loggers, write the ``running`` summary and open ``metrics.jsonl``."""
        if not self.main:
            return
        out_dir, names = self.rundir.path, self.names
        if self.replaces is not None:  # nothing a new start would overwrite is lost
            say(f"{self.replaces}: {out_dir} starts at step 0; its earlier records are now in {self.rundir.move_aside()}")
        later, malformed = records.truncate_metrics(self.metrics_path, self.start_step)
        if later or malformed:
            say(f"resuming {out_dir} at step {self.start_step}: dropped {later} line(s) of {schema.METRICS_NAME} "
                f"after that step and {malformed} malformed line(s)")
        tags = [names["precision"], names["model"], names["data"], names["regime"], names["strategy"]]
        self.loggers = instantiate_loggers(logger_cfg, RunInfo(
            run_dir=out_dir, run_id=self.rundir.run_id(), config=self.resolved, group=self.run.sweep,
            job_type=names["strategy"], tags=tags + list(self.run.tags),
            name=f"{names['strategy']}-{names['precision']}-{names['workload']}-s{self.run.seed}",
        ))
        records.write_summary(self.summary_path, self.summary("running", None))
        self.writer = records.MetricsWriter(self.metrics_path)

    def emit(self, row: dict) -> None:
        """One line of ``metrics.jsonl``, mirrored to every logger."""
        self.writer.write(row)
        for logger in self.loggers:
            logger.log(row)

    def count(self, step: int, loss: torch.Tensor, skipped: bool, step_time: float, strategy_time: float) -> None:
        """Step ``step`` is done: its loss joins the window; counters and (after ``train.warmup``)
        the timing sums advance."""
        self.losses.add(loss)
        c = self.counters
        c["steps"] = step
        c["skipped_steps"] += int(skipped)
        c["consecutive_skips"] = c.get("consecutive_skips", 0) + 1 if skipped else 0
        if step > self.run.train.warmup:
            c["timed_steps"] += 1
            c["step_time_sum"] += step_time
            c["strategy_time_sum"] += strategy_time

    def fidelity(self, step: int, probed: dict, seconds: float) -> None:
        """A fidelity line; its probe time is kept out of step time and strategy overhead."""
        self.counters["fidelity_time_s"] = self.counters.get("fidelity_time_s", 0.0) + seconds
        self.emit({"kind": schema.KIND_FIDELITY, "step": step, **probed})

    def train_line(self, step: int, loss: torch.Tensor, skipped: bool, strategy: Any, own_stats: dict,
                   hook_stats: dict, lr: float, step_time: float, strategy_time: float,
                   extra: dict | None = None) -> dict:
        """Write the train line of ``step`` (see the module docstring; ``extra``: the workload's own
        values, e.g. the rl workload's ``reward`` and ``kl_ref``) and return it."""
        loss_val, loss_avg = self.losses.read(loss)
        row: dict[str, Any] = {"kind": schema.KIND_TRAIN, "step": step}
        row.update(telemetry.flatten(telemetry.read(strategy), strategy.group_names, own_stats))
        row.update(loss=loss_val, loss_avg=loss_avg, skipped=skipped, skipped_total=self.counters["skipped_steps"])
        row.update(hook_stats)
        row.update(lr=lr, step_time_s=step_time, strategy_time_s=strategy_time)
        row.update(extra or {})
        self.emit(row)
        if self.trace is not None:
            self.trace.flush(step, row.get("act_exp_hist"))
        return row

    def eval_line(self, step: int, ev: dict) -> None:
        self.emit({"kind": schema.KIND_EVAL, "step": step, **ev})

    def checkpoint(self, step: int, status: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   strategy: Any) -> None:
        """Rank 0 (when ``train.checkpoint_every > 0``): everything a resume needs, atomically (under
        FSDP2 every rank first helps gather the full state dicts: :func:`distributed.full_state`)."""
        if self.run.train.checkpoint_every <= 0:
            return
        model_state, optim_state = dist.full_state(model, optimizer)
        if not self.main:
            return
        if self.trace is not None:  # a resume from this step finds every row up to it
            self.trace.flush(step)
        ckpt.save(
            self.rundir.path / schema.CHECKPOINT_NAME,
            {"step": step, "status": status, "config": records.redact(self.resolved),
             "model": model_state, "optimizer": optim_state,
             "strategy": strategy.state_dict(), "rng": ckpt.capture_rng(), "data_position": step,
             "counters": dict(self.counters), "loss_window": self.losses.state(), "segments": self.segments},
        )
        self.saved_at = step

    def summary(self, status: str, error: str | None) -> dict:
        """The summary of rank 0's record (every rank reads it from the shared file system)."""
        rows = records.read_metrics(self.metrics_path)
        keep = self.resolved.get("model", {}).get("keep_fp32")
        return {"status": status, "error": error, **self.head, **records.summarize(rows, self.counters),
                "diverged": status == "diverged", "survived": status == "completed",
                **({"keep_fp32": [str(k) for k in keep]} if keep else {}), "fingerprint": self.fingerprint,
                "segments": self.segments}

    def finish(self, summary: dict, exit_code: int) -> None:
        """Rank 0: write the final ``summary.json`` and close the loggers with it."""
        if self.main:
            records.write_summary(self.summary_path, summary)
            for logger in self.loggers:
                logger.finish(summary, exit_code=exit_code)

    def close(self) -> None:
        self.writer.close()
        if self.trace is not None:
            self.trace.flush(self.counters["steps"])
            self.trace.close()
