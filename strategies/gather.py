"""The statistics pass over an optimizer's gradients, reduced across ranks where they are spread.

:func:`gather` is what :meth:`strategies.base.Strategy.unscale_` runs: per device, one
:func:`strategies.stats.unscale_and_stats` pass (the fused kernel or its plain-torch oracle) over the
tensors this rank holds — a DTensor gradient's local shard (FSDP2), the values of a sparse one —
then, under ``torch.distributed``, one reduction that gives every rank the statistics of the whole
gradient (:mod:`strategies.sharding`: replicated gradients MAX-reduced, sharded ones SUM-reduced).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from strategies.sharding import all_reduce_parts, layout, local, max_over_ranks_
from strategies.schedule import sampled
from strategies.stats import GradStats, unscale_and_check, unscale_and_stats

__all__ = ["gather", "grads_by_device"]

Grads = dict[torch.device, list[torch.Tensor]]


def grads_by_device(
    optimizer: torch.optim.Optimizer, allow_fp16: bool = False, setting: str | None = None, who: str = "scalelab",
) -> tuple[Grads, Grads, dict[torch.device, list[bool]]]:
    """The parameters with a gradient, the gradients this rank holds (a DTensor's local shard, the
    values of a sparse one) and, when ``setting`` (a resolved ``distributed`` mode) is given,
    whether each is sharded across ranks (:func:`strategies.sharding.layout`), by device.

    Raises ``ValueError`` for an fp16 gradient unless ``allow_fp16``, as GradScaler does (fp16
    master gradients are unsafe to unscale; a fused optimizer that unscales them itself is fine,
    and ``ShardedGradScaler`` takes them). A sparse fp16 gradient is coalesced first, as torch does:
    its duplicate indices may sum to an overflow."""
    params: Grads = defaultdict(list)
    grads: Grads = defaultdict(list)
    sharded: dict[torch.device, list[bool]] = defaultdict(list)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.dtype == torch.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if p.grad.is_sparse and p.grad.dtype == torch.float16:  # as torch: check the coalesced values
                p.grad = p.grad.float().coalesce().half()  # (summed in fp32: fp16 has no CPU coalesce)
            g = local(p.grad)
            g = g._values() if g.is_sparse else g
            params[g.device].append(p)
            grads[g.device].append(g)
            if setting is not None:
                sharded[g.device].append(layout(p, p.grad, setting, who) == "sharded")
    return params, grads, sharded


def gather(
    optimizer: torch.optim.Optimizer,
    scale: torch.Tensor,
    *,
    unscale: bool = True,
    with_stats: bool = True,
    group_index: Callable[[list[torch.Tensor]], list[int] | None] | None = None,
    num_groups: int = 1,
    mode: str | None = None,
    allow_fp16: bool = False,
    who: str = "scalelab",
    sample: float = 1.0,
) -> tuple[dict[torch.device, torch.Tensor], GradStats | None]:
    """One pass over ``optimizer``'s gradients, per device: unscale them in place by ``1/scale``
    (shape ``[]`` or ``[num_groups]``; ``group_index(params)`` gives each one's group) and return
    ``(found_inf per device, statistics or None)``.

    ``unscale=False`` only reads them (a fused optimizer unscales them itself; fp16 gradients are
    then accepted) and turns the statistics into those of the unscaled values (abs-max x 1/S, sum
    of squares x 1/S^2: exact for power-of-two scales). ``with_stats=False`` runs torch's
    found-inf-only op. ``sample < 1`` (one group, not ``parts``: ``stats_layers``,
    :mod:`strategies.schedule`): statistics of the :func:`strategies.schedule.sampled` share of the
    tensors, the found-inf pass over the others. ``mode`` (a resolved ``distributed`` setting: ``"auto"``, ``"replicated"``,
    ``"sharded"``) reduces across ranks, every rank joining (also one without gradients):
    ``"replicated"`` MAX-reduces everything in one collective (:meth:`GradStats.all_reduce`); the
    others count each gradient's statistics in the replicated or the sharded half of ``2G`` groups
    and reduce them with :func:`strategies.sharding.all_reduce_parts`; without statistics only the
    found_inf flag is MAX-reduced. The result is then one found_inf on the scale's device. No sync.
    """
    parts = mode is not None and mode != "replicated"
    groups = 2 * num_groups if parts and with_stats else num_groups
    params, grads, sharded = grads_by_device(optimizer, allow_fp16 or not unscale, mode, who)
    # FP32 division can be imprecise for some compile options, so (as torch) the reciprocal is
    # taken in FP64.
    inv_all = scale.double().reciprocal().float()
    found: dict[torch.device, torch.Tensor] = {}
    total: GradStats | None = None
    for device, gs in grads.items():
        inv = inv_all.to(device, non_blocking=True) if unscale else _one(device)
        if with_stats:
            index = group_index(params[device]) if group_index is not None else None
            if parts:  # the sharded gradients count in groups G..2G-1
                index = [(0 if index is None else index[i]) + num_groups * s for i, s in enumerate(sharded[device])]
                inv = torch.cat([inv.reshape(-1)] * 2) if inv.numel() > 1 else inv
            if sample < 1.0 and index is None and not parts:
                st = _sampled_pass(gs, inv, sample)
            else:
                st = unscale_and_stats(gs, inv, index, groups)
            # one group: a view of its flag, not a reduction (every op here runs after the pass
            # has evicted the caches, so each costs several microseconds on a large model)
            found[device] = st.found_inf.view(()) if groups == 1 else st.found_inf.amax()
            if device != scale.device:
                st = st.to(scale.device)
            total = st if total is None else total.combine(st)
        else:
            f = torch.zeros((), dtype=torch.float32, device=device)
            unscale_and_check(gs, inv, f)
            found[device] = f
    if total is not None and not unscale:
        total.absmax.mul_(inv_all)
        total.sumsq.mul_(inv_all * inv_all)
    if mode is None:
        return found, total
    if not with_stats:  # the flag alone, the same on every rank
        flags = [f.to(scale.device, non_blocking=True) for f in found.values()]
        flag = torch.stack(flags).amax() if flags else torch.zeros((), dtype=torch.float32, device=scale.device)
        return {scale.device: max_over_ranks_(flag)}, None
    total = total if total is not None else GradStats.empty(groups, scale.device)
    total = all_reduce_parts(total, num_groups) if parts else total.all_reduce("replicated")
    return {scale.device: total.found_inf.amax()}, total


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on ``device``, made once (the read-only pass's scale; a new one per step was a
    kernel launch on a GPU). The pass only reads it."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), device=device)
    return one


def _sampled_pass(gs: list[torch.Tensor], inv: torch.Tensor, sample: float) -> GradStats:
    """The statistics of the sampled gradients, with found_inf over all of them: the others go
    through the found-inf-only pass (unscaled in place all the same)."""
    keep = sampled(len(gs), sample)
    chosen = set(keep)
    rest = [g for j, g in enumerate(gs) if j not in chosen]
    st = unscale_and_stats([gs[j] for j in keep], inv)
    if rest:
        f = torch.zeros((), dtype=torch.float32, device=inv.device)
        unscale_and_check(rest, inv, f)
        st.found_inf = torch.maximum(st.found_inf, f)
    return st
