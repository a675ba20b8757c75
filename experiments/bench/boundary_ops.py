"""``scalelab-bench`` section (c3): the layer-boundary ops, one activation gradient at a time.

What a per-layer rule reads at every boundary in backward (``cuda/cpu/boundary_cpu.cpp``):
``grad_extremes`` (an overflow check inside a group), ``boundary_rescale`` (a crossing: the rescaled
copy and the check in one pass) and ``exponent_histogram`` (``underflow_target``), each on 2^17
entries (the bench MLP's 256 x 512 boundary) of float32, float16 and bfloat16, against its
plain-torch reference (``strategies.stats``, ``strategies.group_links.times``) in the same rounds.
Two inputs: ``normal`` (a Gaussian, as an activation gradient) and ``wide`` (magnitudes spread
uniformly over 40 binades: the histogram's slow case, where many entries fall below the 32 fields its
vector lanes count). µs per call, median over rounds of :data:`CALLS` calls; one thread.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from experiments.bench.common import paired_ms, paired_ratio
from experiments.bench.steps import table
from strategies import kernels
from strategies.group_links import times
from strategies.stats import exponent_histogram_reference, extremes_reference

__all__ = ["CALLS", "OPS_ROUNDS", "SIZE", "bench_boundary_ops", "format_boundary_ops", "gradient"]

SIZE = 2**17
CALLS = 50
"""Calls per timed block (an op takes 5-40 us here)."""
OPS_ROUNDS = 9
"""Rounds (``scalelab-bench`` without ``--quick`` or ``--repeats``)."""
RATIO = torch.tensor([0.3])  # not a power of two: the 16-bit products round


def gradient(kind: str, dtype: torch.dtype, n: int = SIZE) -> torch.Tensor:
    """``normal``: N(0, 1e-2); ``wide``: +-1.3 * 2^-k, k uniform in 0..39 (seeded)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "normal":
        g = torch.randn(n, generator=gen) * 1e-2
    else:
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        g = sign * 1.3 * torch.exp2(-torch.randint(0, 40, (n,), generator=gen).float())
    return g.to(dtype)


def _ops(g: torch.Tensor) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    ops = torch.ops.scalelab
    return {"grad_extremes": (lambda: ops.grad_extremes(g), lambda: extremes_reference(g)),
            "boundary_rescale": (lambda: ops.boundary_rescale(g, RATIO, 0),
                                 lambda: (times(g, RATIO[0]), extremes_reference(g))),
            "exponent_histogram": (lambda: ops.exponent_histogram(g), lambda: exponent_histogram_reference(g))}


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def bench_boundary_ops(rounds: int, calls: int = CALLS, n: int = SIZE) -> list[dict[str, Any]]:
    """Per (op, dtype, input): ``op_us``, ``reference_us`` and ``speedup`` (median over rounds of
    reference / op in the same round). ``[]`` where the ops are not built (no kernels)."""
    if not kernels.load():
        return []
    rows = []
    for kind, names in (("normal", ("grad_extremes", "boundary_rescale", "exponent_histogram")),
                        ("wide", ("exponent_histogram",))):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ops = _ops(gradient(kind, dtype, n))
            for name in names:
                op, ref = ops[name]
                t = paired_ms({"op": _repeated(op, calls), "reference": _repeated(ref, calls)}, rounds,
                              clock=time.thread_time)
                rows.append({"op": name, "dtype": str(dtype).removeprefix("torch."), "input": kind,
                             "op_us": statistics.median(t["op"]) * 1e3 / calls,
                             "reference_us": statistics.median(t["reference"]) * 1e3 / calls,
                             "speedup": paired_ratio(t["reference"], t["op"]), "rounds": rounds, "calls": calls})
    return rows


def format_boundary_ops(rows: list[dict[str, Any]]) -> str:
    calls = rows[0]["calls"] if rows else CALLS
    head = [f"(c3) the layer-boundary ops on one {SIZE}-entry activation gradient (the MLP's 256 x 512), CPU us per",
            f"    call (thread_time), median over rounds of {calls} calls; reference: the same in plain torch;",
            "    speedup: median over rounds of reference / op; input normal: N(0, 1e-2), wide: over 40 binades"]
    if not rows:
        return "\n".join([*head, "", "  (the kernel extension is not built: nothing to time)"])
    return table(head, [("op", "op", 20, "s"), ("dtype", "dtype", 10, "s"), ("input", "input", 8, "s"),
                        ("op", "op_us", 9, ".1f"), ("reference", "reference_us", 11, ".1f"),
                        ("speedup", "speedup", 10, "x")], rows)
