"""Whether a strategy's whole training step (scaled backward, ``step`` with a fused optimizer,
``update``) can be captured in one CUDA graph with the skip decision on the device (issue 33,
item 4), and the loop both capture tests run.

A graph replays the device work recorded once, so a capturable step must (1) read nothing on the
host, (2) dispatch the same ops with the same non-tensor arguments on every step, an overflow step
included (a value that changes per step, e.g. a Python counter passed to an op, would be frozen at
its captured value), and (3) build no tensor from host data once warm (``aten.lift_fresh``: on a GPU
a copy from pageable memory, which capture refuses). :class:`OpTrace` records (2) and (3) on the
CPU; ``tests/cuda/test_capture_step.py`` captures and replays on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import strategies
from strategies.floor import raises
from tests.helpers import strategy_cases

__all__ = ["MULTS", "OpTrace", "capture_blocker", "capture_cases", "probing", "train_steps"]

MULTS = (1.0, 1.0, 1.0, float("inf"), 1.0, 1.0, 1.0, 1.0)
"""The loss multiplier of each step: the fourth overflows (every gradient non-finite, skipped)."""


class OpTrace(TorchDispatchMode):
    """Every dispatched op (profiler markers left out) with the repr of its non-tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not str(func).startswith("profiler."):
            other = [a for a in pytree.tree_leaves((args, kwargs)) if not isinstance(a, torch.Tensor)]
            self.ops.append((str(func), repr(other)))
        return func(*args, **kwargs)


def probing(name: str) -> bool:
    """Whether rule ``name`` runs the fp32 reference probe on a host schedule (``probe_interval``)."""
    return hasattr(strategies.get(name), "probe_due")


def capture_blocker(name: str, kw: dict) -> str:
    """Why rule ``name`` with keywords ``kw`` cannot be captured as one graph ("" when it can)."""
    if probing(name):
        return "the fp32 reference probe runs on a host schedule (probe_interval) and adds host time to its telemetry"
    if raises(strategies.create(name, **kw).params):
        return "on_min_scale='raise' writes the host's update number into the fault state"
    return ""


def capture_cases() -> tuple[list[Any], list[Any]]:
    """``tests.helpers.strategy_cases()`` split into the capturable ones and those with a
    :func:`capture_blocker`."""
    blocked = [(c, bool(capture_blocker(*c.values))) for c in strategy_cases()]
    return [c for c, b in blocked if not b], [c for c, b in blocked if b]


def train_steps(s: strategies.Strategy, loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
                mult: torch.Tensor, around: Callable[[], Any]) -> list[list[tuple[str, str]]]:
    """One step per :data:`MULTS` entry (``mult`` filled with it, the loss multiplied by it), each
    inside the context ``around()`` and an :class:`OpTrace`; the traces."""
    traces = []
    for m in MULTS:
        mult.fill_(m)
        opt.zero_grad(set_to_none=False)
        trace = OpTrace()
        with around(), trace:
            s.scale(loss() * mult).backward()
            s.step(opt)
            s.update()
        traces.append(trace.ops)
    return traces
