"""What one run shows of its progress: a tqdm bar on a terminal, plain lines in a log file.

:class:`RunProgress` is the one progress object of the training loop (``train.progress``, main
rank only). The tqdm bar shows only on a terminal; in a log it would be control characters or
nothing. So a single run on the main rank whose stderr is not a terminal instead prints a plain
line at each tenth of its steps (``step 120/400, loss 2.31, scale 6.55e+04, 0
skipped | 1m02s``), and every single run ends with one result line (:func:`result_line`, the
words of a sweep's per-job line). A sweep's jobs print neither: the sweep prints one line per
finished job (:mod:`experiments.app.progress`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from tqdm import tqdm

__all__ = ["clock", "result_line", "single_run", "RunProgress"]


def clock(seconds: float) -> str:
    """``seconds`` as ``1m02s`` (or ``7s``)."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def result_line(summary: dict[str, Any]) -> str:
    """What a finished run reached, from its ``summary.json`` (possibly empty): who it was, its
    status, the rl workload's final reward where there is one, final eval loss and skips; a job
    refused before it wrote a record (``overrides`` and ``error`` only): its overrides and why."""
    if "overrides" in summary:
        return f"failed before training ({summary['overrides']}): {summary.get('error')}"
    who = " ".join(str(summary.get(k, "?")) for k in ("precision", "regime", "strategy"))
    loss = summary.get("final_eval_loss")
    loss_s = f"{loss:.4g}" if isinstance(loss, (int, float)) else "n/a"
    reward = summary.get("final_reward")  # the rl workload's primary metric
    reward_s = f"final reward {reward:.4g}, " if isinstance(reward, (int, float)) else ""
    return (f"{who} seed {summary.get('seed', '?')}: {summary.get('status', 'no record')}, "
            f"{reward_s}final eval loss {loss_s}, {summary.get('skipped_steps', '?')} skipped")


def single_run() -> bool:
    """True outside a Hydra sweep (a single ``scalelab-train`` run, or the loop called directly)."""
    return not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.RUN


class RunProgress:
    """A run's progress from ``start_step`` to ``steps``, shown when ``enabled`` (the run's
    ``train.progress``, on its main rank): a tqdm bar (titled ``name``) when stderr is a terminal;
    else, outside a sweep's jobs, a plain line at each new tenth of the steps."""

    def __init__(self, enabled: bool, steps: int, start_step: int, name: str) -> None:
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=start_step, disable=not (enabled and terminal), desc=name,
                        dynamic_ncols=True)
        self.lines = enabled and not terminal and single_run()
        self.steps, self.start = steps, time.monotonic()
        self.tenth = math.floor(10 * start_step / steps) if steps else 10

    def logged(self, step: int, row: dict[str, Any]) -> None:
        """After the train line of logging step ``step`` (``row``): the bar's loss and scale, or a
        line if a new tenth is reached."""
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", scale=f"{row['scale']:.3g}", refresh=False)
        tenth = math.floor(10 * step / self.steps) if self.steps else 10
        if not self.lines or tenth <= self.tenth:
            return
        self.tenth = tenth
        print(f"scalelab-train: step {step}/{self.steps}, loss {row['loss']:.4g}, scale {row['scale']:.3g}, "
              f"{row.get('skipped_total', 0)} skipped | {clock(time.monotonic() - self.start)}",
              file=sys.stderr, flush=True)

    def advance(self) -> None:
        """One more step done."""
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
