"""``scalelab-bench`` section (c2): the layer-boundary hooks' host cost, where nothing else hides it.

Section (c) times the per-layer rules on models whose matmuls dominate the step, so what the hooks'
Python costs is a few percent there, inside the spread between processes. A step that is
launch-bound (a small model on a GPU: bench.md (iii), 7-8 ms of host time for ~1 ms of kernels) pays
that Python in full. This section measures it on a 9-layer MLP of width 16 (batch 4), where the
step is all host work: microseconds per forward and per training step (forward, scaled backward,
unscale_/step (no-op)/update) with the rule attached, minus the same without. Each round times
:data:`CALLS` calls of every configuration in turn; the median over rounds. One process, one
thread: compare the rows, and a row with the same row of another commit on the same machine.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch

from experiments.bench.common import HOOKED, NoOpOptimizer, make_scaler, paired_ms, quiet, train_step
from experiments.bench.steps import table

__all__ = ["CALLS", "HOST_ROUNDS", "bench_hook_host", "format_hook_host"]

CALLS = 200
"""Calls per timed block (a forward of the MLP is ~60 us here: one call is below the clock's grain)."""
HOST_ROUNDS = 15
"""Rounds (``scalelab-bench`` without ``--quick`` or ``--repeats``): medians moved by ~5 us between runs."""
LAYERS = 9


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    width = 16
    layers = [m for _ in range(LAYERS - 1) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)), torch.randn(4, width)


def bench_hook_host(rounds: int, calls: int = CALLS) -> list[dict[str, Any]]:
    """Per rule of :data:`experiments.bench.common.HOOKED`: ``forward_us`` and ``step_us`` attached,
    the same of the plain copy, and the differences ``extra_forward_us``, ``extra_step_us``."""
    model, x = _model()

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    with quiet():
        copies = {"plain": (model, make_scaler("layerwise"))}
        for label in HOOKED:
            m = copy.deepcopy(model)
            copies[label] = (m, make_scaler(label).attach(m))
        opts = {key: NoOpOptimizer(list(m.parameters())) for key, (m, _) in copies.items()}

        def forward(key: str) -> Callable[[], None]:
            m = copies[key][0]

            def run() -> None:
                for _ in range(calls):
                    m(x)  # each output (and its graph) is freed before the next call
            return run

        def step(key: str) -> Callable[[], None]:
            m, s = copies[key]

            def run() -> None:
                for _ in range(calls):
                    train_step(m, s, opts[key], loss_of)
            return run

        runs = {(kind, key): make(key) for kind, make in (("forward", forward), ("step", step)) for key in copies}
        t = paired_ms(runs, rounds, clock=time.thread_time)
    for label in HOOKED:
        copies[label][1].detach()
    us = {k: statistics.median(v) * 1e3 / calls for k, v in t.items()}
    return [{"strategy": label, "forward_us": us[("forward", label)], "step_us": us[("step", label)],
             "plain_forward_us": us[("forward", "plain")], "plain_step_us": us[("step", "plain")],
             "extra_forward_us": us[("forward", label)] - us[("forward", "plain")],
             "extra_step_us": us[("step", label)] - us[("step", "plain")], "rounds": rounds, "calls": calls}
            for label in HOOKED]


def format_hook_host(rows: list[dict[str, Any]]) -> str:
    rounds, calls = (rows[0]["rounds"], rows[0]["calls"]) if rows else (0, CALLS)
    return table(["(c2) the hooks' host cost: a 9-layer MLP of width 16 (batch 4), where a step is all host work; CPU us",
                  f"    (thread_time) per forward and per training step, median over {rounds} rounds of {calls} calls; extra:",
                  f"    attached minus plain (the hooks' Python and small ops over {LAYERS} hooked calls)"],
                 [("strategy", "strategy", 20, "s"), ("plain fwd", "plain_forward_us", 11, ".1f"),
                  ("fwd", "forward_us", 9, ".1f"), ("extra", "extra_forward_us", 9, ".1f"),
                  ("plain step", "plain_step_us", 12, ".1f"), ("step", "step_us", 9, ".1f"),
                  ("extra", "extra_step_us", 9, ".1f")], rows)
