"""What a sweep shows while it runs (a Hydra callback, registered in ``conf/config.yaml``).

* Before any job starts (``on_multirun_start``, in the launching process): the kernel extension is
  built once (:func:`strategies.kernels.load`), so parallel workers load it from the cache instead
  of all compiling it at the same time; the sweep's job count and start time are written to
  ``<sweep dir>/.progress/start.json``.
* After each job (``on_job_end``, in the worker that ran it): one line —
  ``[ 37/270] fp16 tiny_grad max_ema seed 3: completed, final eval loss 2.412, 0 skipped | 1m12s,
  ETA 3m40s`` — on stderr. Workers are separate processes, so the jobs done are counted from
  ``<sweep dir>/.progress/done`` (one appended line per finished job: a job's number is the file
  offset just past its own append, atomic on a local file system) and the ETA is the elapsed time per finished job times
  the jobs left (two workers finish jobs in parallel, so this already counts in the parallelism).

A single run (no ``-m``) prints nothing here: it has its own progress bar (``train.progress``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import strategies.kernels as kernels
from experiments.app.records import read_json
from experiments.schema import SUMMARY_NAME
from experiments.app.train import group_options

__all__ = ["count_jobs", "clock", "job_line", "SweepProgress"]

START, DONE = "start.json", "done"


def count_jobs(params: dict[str, str], task: list[str]) -> int:
    """The number of jobs Hydra's basic sweeper makes of its ``params`` and the command line's
    overrides ``task`` (a later sweep of a key replaces an earlier one, as in the sweeper)."""
    sizes: dict[str, int] = {}
    overrides = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(task))
    for o in overrides:
        key = o.get_key_element()
        if not o.is_sweep_override():
            sizes[key] = 1
        elif isinstance(o.value(), Glob):
            sizes[key] = len(o.value().filter(group_options(key)))  # type: ignore[union-attr]
        else:
            sizes[key] = len(list(o.sweep_string_iterator()))
    return math.prod(sizes.values()) if sizes else 1


def clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def job_line(done: int, total: int, elapsed: float, summary: dict[str, Any]) -> str:
    """The line printed when a job finishes (``summary``: its ``summary.json``, possibly empty)."""
    who = " ".join(str(summary.get(k, "?")) for k in ("precision", "regime", "strategy"))
    loss = summary.get("final_eval_loss")
    loss_s = f"{loss:.4g}" if isinstance(loss, (int, float)) else "n/a"
    reward = summary.get("final_reward")  # the rl workload's primary metric
    reward_s = f"final reward {reward:.4g}, " if isinstance(reward, (int, float)) else ""
    width = len(str(total))
    eta = elapsed / done * max(total - done, 0) if done else float("nan")
    return (f"[{done:>{width}}/{total}] {who} seed {summary.get('seed', '?')}: {summary.get('status', 'no record')}, "
            f"{reward_s}final eval loss {loss_s}, {summary.get('skipped_steps', '?')} skipped | {clock(elapsed)}, "
            f"ETA {clock(eta) if math.isfinite(eta) else '?'}")


class SweepProgress(Callback):
    """See the module docstring."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir)) / ".progress"
        folder.mkdir(parents=True, exist_ok=True)
        params = config.hydra.sweeper.get("params") or {}
        params = OmegaConf.to_container(params, resolve=False) if isinstance(params, DictConfig) else dict(params)
        total = count_jobs({str(k): str(v) for k, v in params.items()}, list(config.hydra.overrides.task))
        kernels.load()  # says itself when it builds (strategies/kernels.py)
        (folder / DONE).unlink(missing_ok=True)  # a re-run counts its own jobs (finished ones return at once)
        (folder / START).write_text(json.dumps({"total": total, "start": time.time()}))
        print(f"scalelab-train: {total} jobs into {config.hydra.sweep.dir}; one line per finished job",
              file=sys.stderr, flush=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hydra_cfg = getattr(job_return, "hydra_cfg", None)
        if hydra_cfg is None or "MULTIRUN" not in str(hydra_cfg.hydra.mode):
            return
        folder = Path(str(hydra_cfg.hydra.sweep.dir)) / ".progress"
        start = read_json(folder / START)
        summary = read_json(Path(str(hydra_cfg.hydra.runtime.output_dir)) / SUMMARY_NAME)
        try:
            fd = os.open(folder / DONE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"1\n")
                # This job's own position: the offset just past its append (a later read of the file
                # could count another worker's append too, and two jobs would print one number).
                done = os.lseek(fd, 0, os.SEEK_CUR) // 2
            finally:
                os.close(fd)
        except OSError:
            done = 0
        total = int(start.get("total", 0)) or done
        elapsed = time.time() - float(start.get("start", time.time()))
        line = job_line(done, max(total, done), elapsed, summary) + "\n"
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), line.encode())  # one write: workers' lines never interleave
