"""Training runs of every strategy under FSDP2 (2 gloo ranks) and on one process, step for step.

The FSDP2 run and the one-process run see the same gradients bit for bit: the global batch of
``B`` rows is split in two halves; rank r trains on half r and FSDP2's reduce-scatter averages,
``(g_0 + g_1) / 2``; the one process runs the two halves as two micro-batches (gradient
accumulation) with the same loss and halves the accumulated gradient (exact), so its gradient is
``(g_0 + g_1) / 2`` too, and every activation gradient a layer boundary sees is the same as on the
rank that ran that half. What differs is only where the statistics are computed (shards, then
reduced across ranks), which is what the tests check.

Faults are injected after backward into one rank's local shard (an Inf at step ``INF_STEP`` on
rank 1, a NaN at ``NAN_STEP`` on rank 0) and, in the one-process run, into the same entry of the
whole gradient.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.distributed.fsdp import fully_shard

import strategies
from tests.helpers import forbid_host_sync, fp16_safe, mlp, strategy_cases

__all__ = ["CASES", "INF_STEP", "NAN_STEP", "STEPS", "WORLD", "fsdp2_all", "one_process", "run_steps"]

WORLD, STEPS, BATCH, HALF = 2, 6, 8, 4
INF_STEP, NAN_STEP = 2, 4
# layer 0's weight is [16, 8]: FSDP2 shards dim 0, rank 1 holds rows 8..15
INF_AT, NAN_AT = (1, (0, 0), (8, 0)), (0, (1, 2), (1, 2))  # (rank, local index, index in the whole gradient)
EXTRA: dict[str, dict[str, Any]] = {"norm_ratio": {"probe_interval": 1}}


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(case id, rule, keywords): every rule and preset, and every rule with ``track_stats=False``."""
    out = []
    for c in strategy_cases():
        name, kw = c.values
        out.append((c.id, name, {**fp16_safe(kw), "init_scale": 2.0**10, "growth_interval": 1, **EXTRA.get(name, {})}))
    out += [(f"{cid}-nostats", name, {**kw, "track_stats": False}) for cid, name, kw in out
            if cid in strategies.available()]
    return out


CASES = _cases()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g) * 4, torch.randn(BATCH, 4, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).square().sum() / HALF


def _inject(grads: Callable[[], torch.Tensor], step: int, rank: int | None) -> None:
    """Write the step's fault into layer 0's weight gradient (``rank`` None: the whole gradient)."""
    for at_step, (r, loc, whole) in ((INF_STEP, INF_AT), (NAN_STEP, NAN_AT)):
        if step == at_step and rank in (None, r):
            grads()[loc if rank is not None else whole] = float("inf") if at_step == INF_STEP else float("nan")


def run_steps(strat: strategies.Strategy, model: torch.nn.Module, halves: list[int], rank: int | None,
              weight_grad: Callable[[], torch.Tensor], full_params: Callable[[], torch.Tensor]) -> list[dict]:
    """STEPS steps of SGD under fp16 autocast over the given batch halves; one record per step.
    After the first step, ``unscale_`` and ``update`` read nothing on the host (the new collectives
    and the fp32 probe through FSDP2 included)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    current: dict[str, torch.Tensor] = {}

    def reference() -> torch.Tensor:  # the mean over the halves, as the ranks' average
        return sum(loss_of(model, *current[h]) for h in halves) / len(halves)

    strat.attach(model)
    strat.set_reference(reference)
    records = []
    for step in range(STEPS):
        x, y = batch(step)
        for h in halves:
            current[h] = (x[h * HALF:(h + 1) * HALF], y[h * HALF:(h + 1) * HALF])
        opt.zero_grad(set_to_none=True)
        for h in halves:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, *current[h])
            strat.scale(loss).backward()
        if len(halves) > 1:  # what the ranks' reduce-scatter does
            for p in model.parameters():
                p.grad.div_(len(halves))
        _inject(weight_grad, step, rank)
        with forbid_host_sync() if step else nullcontext():  # after the first step's rank check: no host read
            strat.unscale_(opt)
        strat.step(opt)  # GradScaler's one read (found_inf)
        with forbid_host_sync() if step else nullcontext():
            strat.update()
        records.append({"scale": strat.get_scale(), "params": full_params(),
                        "telemetry": {k: v.detach().clone() for k, v in strat.telemetry().items()}})
    return records


def one_process(name: str, kw: dict[str, Any]) -> list[dict]:
    """The run on one process: both halves as micro-batches."""
    model = mlp(seed=0)
    strat = strategies.create(name, "cpu", **kw)
    return run_steps(strat, model, [0, 1], None, lambda: model[0].weight.grad,
                     lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def _fsdp2_run(name: str, kw: dict[str, Any], rank: int) -> list[dict] | str:
    model = mlp(seed=0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    strat = strategies.create(name, "cpu", **kw)
    try:
        return run_steps(strat, model, [rank], rank, lambda: model[0].weight.grad._local_tensor,
                         lambda: torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]))
    except Exception as exc:  # recorded, so one failing rule does not take the others down
        return f"{type(exc).__name__}: {exc}"


def fsdp2_all(rank: int) -> dict:
    """Every case's FSDP2 run on this rank (run it with :func:`tests.strategies.gloo.run_ranks`)."""
    return {cid: _fsdp2_run(name, kw, rank) for cid, name, kw in CASES}
