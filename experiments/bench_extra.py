"""``scalelab-bench`` sections (c) and (d): what attaching costs the attach-based rules per training
step, and what a fused optimizer saves by unscaling in its own kernel; and the pieces every section
(CPU and GPU, :mod:`experiments.bench_gpu`) shares: sizes, the benchmark gradients, the scalers and
their step, a no-op optimizer, paired shuffled rounds.

(c) **Attach cost per step** — forward + scaled backward + unscale_/step/update of a fixed MLP
(8 x 512-wide layers, batch 256), with the strategy attached (its layer-boundary transforms run,
and it gathers what it needs per step: AdaLoss's weight statistics) and without; the difference is
the hooks' cost per backward plus those statistics. Only the strategies whose ``attach`` installs
hooks.

(d) **Fused AdamW** — ``AdamW(fused=True)`` stepping the benchmark's gradients: with
``unscale_()`` first (the strategy's own in-place pass, then the optimizer) and without it (the
optimizer unscales in its kernel; the strategy only reads the gradients for its statistics, as
``torch.amp.GradScaler`` hands ``grad_scale`` over). The difference is the pass saved.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import strategies

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


def scaling_step(scaler: Any, opt: torch.optim.Optimizer, loss: torch.Tensor) -> Callable[[], None]:
    """One training step's scaling calls — ``scale(loss)``, ``unscale_``, ``step``, ``update`` —
    or, for ``scaler=None`` (no scaling), the loss used as is and ``opt.step()``."""

    def run() -> None:
        if scaler is None:
            _ = loss * 1.0
            opt.step()
        else:
            _ = scaler.scale(loss)
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


def _paired_ms(runs: dict[str, Any], repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """Milliseconds of each call per round; every round runs each once, in a shuffled order, so
    drift and position hit both sides of a comparison alike (as section (a))."""
    for fn in runs.values():  # warm-up
        fn()
    order, out = random.Random(seed), {k: [] for k in runs}
    for _ in range(repeats):
        for k in order.sample(list(runs), len(runs)):
            t0 = time.perf_counter()
            runs[k]()
            out[k].append(1e3 * (time.perf_counter() - t0))
    return out


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def bench_hooks(repeats: int) -> list[dict[str, Any]]:
    """Two copies of one MLP, one with the strategy attached, timed round by round: a training
    step's forward, scaled backward and unscale_/step (no-op optimizer)/update, so the attached
    side pays its hooks and what it gathers per step (AdaLoss: the weight statistics)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())],
                                torch.nn.Linear(512, 1))
    x, y = torch.randn(256, 512), torch.randn(256, 1)
    rows = []
    for label, kw in HOOKED.items():
        name = "layerwise" if label.startswith("layerwise") else label
        attached_model = copy.deepcopy(model)
        plain = strategies.create(name, **kw)
        hooked = strategies.create(name, **kw).attach(attached_model)

        opts = {id(model): NoOpOptimizer(list(model.parameters())),
                id(attached_model): NoOpOptimizer(list(attached_model.parameters()))}

        def train_step(m: torch.nn.Module, s: Any) -> None:
            m.zero_grad(set_to_none=True)
            s.scale(F.mse_loss(m(x), y)).backward()
            s.step(opts[id(m)])
            s.update()

        t = _paired_ms({"plain": lambda: train_step(model, plain),
                        "hooked": lambda: train_step(attached_model, hooked)}, repeats)
        hooked.detach()
        t_plain, t_hooked = statistics.median(t["plain"]), statistics.median(t["hooked"])
        rows.append({"strategy": label, "plain_ms": t_plain, "attached_ms": t_hooked,
                     "extra_ms": t_hooked - t_plain, "ratio": paired_ratio(t["hooked"], t["plain"])})
    return rows


def bench_fused(params: list[torch.nn.Parameter], master: list[torch.Tensor], names: list[str],
                repeats: int) -> list[dict[str, Any]]:
    """Per strategy: a separate unscale_() then the fused step, against the fused step unscaling
    itself; the two share one optimizer (lr 0: the parameters never move), timed round by round."""
    opt = torch.optim.AdamW(params, lr=0.0, fused=True)
    loss = torch.ones((), requires_grad=True)
    rows = []
    for name in names:
        if name == "none":
            continue
        scaler = make_scaler(name)

        def run(unscale_first: bool) -> None:
            torch._foreach_copy_([p.grad for p in params], master)
            scaler.scale(loss)
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

        t = _paired_ms({"separate": lambda: run(True), "fused": lambda: run(False)}, repeats)
        t_sep, t_fused = statistics.median(t["separate"]), statistics.median(t["fused"])
        rows.append({"strategy": name, "unscale_then_step_ms": t_sep, "fused_ms": t_fused, "saved_ms": t_sep - t_fused})
    return rows


def format_hooks(rows: list[dict[str, Any]]) -> str:
    lines = ["(c) attach-based rules, attached vs not, per training step of an 8 x 512 MLP (batch 256):",
             "    forward + scaled backward + unscale_/step (no-op)/update, median ms;",
             "    ratio: median over rounds of attached / plain in the same round", "",
             f"  {'strategy':<20}{'plain':>10}{'attached':>12}{'extra':>10}{'ratio':>9}", "  " + "-" * 59]
    lines += [f"  {r['strategy']:<20}{r['plain_ms']:>10.3f}{r['attached_ms']:>12.3f}{r['extra_ms']:>10.3f}"
              f"{r['ratio']:>8.2f}x" for r in rows]
    return "\n".join(lines)


def format_fused(rows: list[dict[str, Any]], size: str) -> str:
    lines = [f"(d) AdamW(fused=True) at {size}: unscale_() then step vs the optimizer unscaling itself, median ms",
             "", f"  {'strategy':<20}{'unscale_+step':>15}{'fused':>10}{'saved':>10}", "  " + "-" * 55]
    lines += [f"  {r['strategy']:<20}{r['unscale_then_step_ms']:>15.3f}{r['fused_ms']:>10.3f}{r['saved_ms']:>10.3f}"
              for r in rows]
    return "\n".join(lines)
