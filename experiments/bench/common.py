"""What every ``scalelab-bench`` section (CPU: :mod:`experiments.bench.cli` and
:mod:`experiments.bench.steps`; GPU: :mod:`experiments.bench.gpu`) shares: sizes, the benchmark
gradients, the scalers and their step, a no-op optimizer, paired shuffled rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch

import strategies

__all__ = ["SUFFIX", "parse_size", "make_params", "restore", "human", "HOOKED", "VARIANTS", "make_scaler",
    "quiet", "scaling_step", "train_step", "NoOpOptimizer", "paired_ms", "paired_ratio", "paired_ratio_interval", "median_interval", "peak_bytes", "ratio_fields"]

SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_size(text: str) -> int:
    """``"50M"`` -> 50_000_000; plain integers accepted."""
    t = text.strip().upper()
    try:
        if t and t[-1] in SUFFIX:
            value = int(float(t[:-1]) * SUFFIX[t[-1]])
        else:
            value = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must look like 1M, 250K or 1000000, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return value


def make_params(numel: int, tensors: int, seed: int = 0,
                device: str = "cpu") -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """``tensors`` float32 parameters on ``device`` holding ``numel`` elements in all, with
    gradients ~ N(0, 1e-3) scaled by 2^16 (as a backward of a scaled loss would produce), plus a
    master copy of them (the same values on every device: drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // tensors + (1 if k < numel % tensors else 0) for k in range(tensors)]
    params, master = [], []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, device=device))
        g = (torch.randn(n, generator=gen) * (1e-3 * 2.0**16)).to(device)
        p.grad = g.clone()
        params.append(p)
        master.append(g)
    return params, master


def restore(params: list[torch.nn.Parameter], master: list[torch.Tensor]) -> None:
    """Gradients back to the master copy (repeated unscaling must not drift into subnormals)."""
    torch._foreach_copy_([p.grad for p in params], master)


def human(n: int) -> str:
    """50_000_000 -> ``"50M"`` (exact multiples of a tenth of K/M/G), else the digits."""
    for suffix, f in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= f and n % (f // 10) == 0:
            return f"{n / f:g}{suffix}"
    return str(n)


HOOKED = {"layerwise": {}, "layerwise_adaloss": {"rule": "adaloss", "init_scale": 1.0}, "underflow_target": {}}
VARIANTS = {"layerwise_adaloss": ("layerwise", HOOKED["layerwise_adaloss"])}
"""Rules that are a setting of a registered strategy (conf/strategy/layerwise_adaloss.yaml), timed
in (a) beside the registered ones."""


def make_scaler(name: str, device: str = "cpu") -> Any:
    """``None`` for "none", torch's GradScaler, a :data:`VARIANTS` entry or a registered strategy,
    on ``device``."""
    if name == "none":
        return None
    if name == "GradScaler":
        return torch.amp.GradScaler(device)
    if name in VARIANTS:
        base, kw = VARIANTS[name]
        return strategies.create(base, device=device, **kw)
    return strategies.create(name, device=device)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The warnings a timing run expects, silenced: probe rules run without a reference closure,
    and underflow_target unattached (the step is timed alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\w+: no reference closure")
        warnings.filterwarnings("ignore", message=r"underflow_target: not attached")
        yield


def train_step(model: torch.nn.Module, scaler: Any, opt: torch.optim.Optimizer,
               loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> None:
    """One training step of ``model`` with ``scaler``: gradients cleared, the scaled loss's
    backward, then ``step`` and ``update``."""
    model.zero_grad(set_to_none=True)
    scaler.scale(loss_of(model)).backward()
    scaler.step(opt)
    scaler.update()


def scaling_step(scaler: Any, opt: torch.optim.Optimizer, loss: torch.Tensor,
                 unscale: bool = True) -> Callable[[], None]:
    """One training step's scaling calls — ``scale(loss)``, ``unscale_``, ``step``, ``update`` —
    or, for ``scaler=None`` (no scaling), the loss used as is and ``opt.step()``. ``unscale=False``
    leaves ``unscale_`` to ``step`` (with a fused optimizer: the optimizer unscales)."""

    def run() -> None:
        if scaler is None:
            _ = loss * 1.0
            opt.step()
        else:
            _ = scaler.scale(loss)
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

    return run


class NoOpOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` does nothing: the benchmark times scaling, not SGD."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # noqa: D102
        return None


class NoOpFusedOptimizer(NoOpOptimizer):
    """A no-op optimizer that takes its scaling as fused Adam/AdamW/SGD do
    (``_step_supports_amp_scaling``): GradScaler and every strategy hand it ``grad_scale`` and
    ``found_inf`` on the device instead of reading ``found_inf`` on the host to skip the step, so a
    step with it never syncs (a fused optimizer skips on the device)."""

    _step_supports_amp_scaling = True


def paired_ms(runs: dict[str, Any], repeats: int, seed: int = 0,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Milliseconds of each call per round; every round runs each once, in a shuffled order, so
    drift and position hit both sides of a comparison alike (as section (a)). ``clock``:
    ``time.perf_counter`` (wall), or ``time.thread_time`` (this thread's CPU time: with one torch
    thread, the work itself, not the time other processes on a shared machine held the core)."""
    for fn in runs.values():  # warm-up
        fn()
    order, out = random.Random(seed), {k: [] for k in runs}
    for _ in range(repeats):
        for k in order.sample(list(runs), len(runs)):
            t0 = clock()
            runs[k]()
            out[k].append(1e3 * (clock() - t0))
    return out


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (independent rounds):
    the order statistics ``x_(k)`` and ``x_(n+1-k)`` (1-based) with the largest ``k`` for which
    ``P(Binomial(n, 1/2) < k) <= (1 - level) / 2``, so the interval covers the true median with
    probability at least ``level``, whatever the distribution of a round. ``(nan, nan)`` when
    ``n`` is too small for ``level`` (n < 6 at 95 %)."""
    x, n = sorted(values), len(values)
    tail, k, cdf = (1.0 - level) / 2.0, 0, 0.0
    while k < n // 2:
        nxt = cdf + math.comb(n, k) / 2.0**n  # P(B <= k) = P(B < k + 1)
        if nxt > tail:
            break
        cdf, k = nxt, k + 1
    return (math.nan, math.nan) if k == 0 else (x[k - 1], x[n - k])


def paired_ratio_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float]:
    """:func:`median_interval` of the per-round ratios a / b: the interval of :func:`paired_ratio`."""
    return median_interval([x / y for x, y in zip(a, b)], level)


def ratio_fields(a: list[float], b: list[float]) -> dict[str, float]:
    """A bench row's ``ratio`` (:func:`paired_ratio` of a over b) and its 95 % interval ``ratio_lo``, ``ratio_hi``."""
    lo, hi = paired_ratio_interval(a, b)
    return {"ratio": paired_ratio(a, b), "ratio_lo": lo, "ratio_hi": hi}


def peak_bytes(fn: Callable[[], Any], device: str = "cuda") -> int:
    """The most memory ``fn`` held allocated at once on a CUDA device beyond what was allocated
    before it (bytes; the caching allocator's ``max_memory_allocated``). The CPU has no such count:
    the profiler's memory events attribute an op's net allocation to its start, and one plain step
    of the bench's MLP read 5, 6 and 8 MiB in three tries, so the CPU bench reports none."""
    if device != "cuda":
        raise ValueError(f"peak_bytes: CUDA only (the CPU allocator keeps no peak), got {device!r}")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
