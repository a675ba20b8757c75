"""Where each gradient lives across ranks, and the reductions that make every rank agree.

A strategy's ``distributed`` setting (:class:`strategies.params.ScalerParams`) says how the
statistics of the gradients must be combined across the ranks of ``torch.distributed``'s default
process group; :func:`distributed_mode` resolves it (None: one process, or ``"off"``). Each
gradient then has a **layout** (:func:`layout`):

* ``"replicated"`` — every rank holds the same full gradient (DDP after its all-reduce, torch's
  ``ZeroRedundancyOptimizer``, a ``Replicate()`` DTensor): its statistics are MAX-reduced (the
  replicas agree; a fault on one rank reaches all).
* ``"sharded"`` — each rank holds a disjoint piece (FSDP2's ``fully_shard`` DTensors with a
  ``Shard`` placement, FSDP1's flat parameters and the views ``use_orig_params=True`` gives, a
  ZeRO-2/3 partition): found_inf and the abs-max are MAX-reduced, the sums and counts SUM-reduced,
  so the step's statistics are those of the whole unsharded gradient.

A DTensor gradient carries its placement, which decides (under every setting but ``"off"``; an
explicit ``"replicated"`` with sharded DTensors is refused). A plain tensor is what the setting
says, and under ``"auto"`` sharded where it is one of FSDP1's (``_fsdp_flattened``; a
``NO_SHARD`` flat parameter is replicated), else replicated. A ZeRO partition of plain tensors
(each rank's optimizer holding its own share of the parameters) is not detectable from the
gradients: give ``distributed="sharded"``.

Refused with one line naming the mode: a DTensor on a device mesh of more than one dimension
(HSDP, FSDP + tensor parallel), on a mesh that is not the whole default group, or with a
``Partial`` placement (an unreduced gradient).

Every collective here packs its tensors into one float64 buffer and never reads it on the host.
"""

from __future__ import annotations

from dataclasses import fields
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from strategies.stats import GradStats

__all__ = [
    "LAYOUTS", "ShardingError", "all_reduce_", "all_reduce_parts", "distributed_mode", "is_sharded_param",
    "layout", "local", "max_over_ranks_", "mean_over_ranks_", "refuse_flat_params",
]

LAYOUTS = ("replicated", "sharded")


class ShardingError(ValueError):
    """A gradient layout a strategy cannot reduce (the message names the mode)."""


def distributed_mode(setting: str) -> str | None:
    """``"auto"``/``"replicated"``/``"sharded"`` when statistics must be reduced across ranks (a
    strategy's ``distributed`` setting), else None: ``"off"``, or no process group of more than one
    rank."""
    if setting == "off" or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return setting


def local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (its storage: in-place writes reach the
    DTensor), else ``grad`` itself."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _dtensor_layout(grad: DTensor, who: str) -> str:
    mesh = grad.device_mesh
    if mesh.ndim != 1:
        raise ShardingError(
            f"{who}: a DTensor gradient on a {mesh.ndim}-D device mesh (HSDP or FSDP + tensor parallel, placements "
            f"{tuple(grad.placements)}) is not supported: use a 1-D mesh over every rank (FSDP2 fully_shard)")
    if mesh.size() != dist.get_world_size():
        raise ShardingError(
            f"{who}: a DTensor gradient on a device mesh of {mesh.size()} of the {dist.get_world_size()} ranks "
            "is not supported: the statistics are reduced over the default process group")
    (placement,) = grad.placements
    if isinstance(placement, Shard):
        return "sharded"
    if isinstance(placement, Replicate):
        return "replicated"
    if isinstance(placement, Partial):
        raise ShardingError(f"{who}: a DTensor gradient with a Partial placement (not reduced yet) cannot be "
                            "unscaled: call the strategy after the backward has reduced the gradients")
    raise ShardingError(f"{who}: DTensor placement {placement!r} is not supported")


def is_sharded_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is managed by FSDP1 and sharded: a flat parameter (``use_orig_params=False``)
    whose shard is smaller than the whole, or a view of one (``use_orig_params=True``; FSDP1 sets
    ``_fsdp_flattened`` on both)."""
    if not getattr(param, "_fsdp_flattened", False):
        return False
    sharded, whole = getattr(param, "_sharded_size", None), getattr(param, "_unpadded_unsharded_size", None)
    return sharded is None or whole is None or sharded.numel() != whole.numel()


def refuse_flat_params(model: torch.nn.Module, who: str) -> None:
    """Raise :class:`ShardingError` when ``model`` holds FSDP1 flat parameters
    (``use_orig_params=False``): one tensor per wrapped module, spanning its layers, so a rule that
    scales or observes per layer cannot tell them apart."""
    if any(hasattr(p, "_unpadded_unsharded_size") and getattr(p, "_fsdp_flattened", False)
           for p in model.parameters()):
        raise ShardingError(f"{who}: FSDP1 with use_orig_params=False trains flat parameters that span layers, so "
                            "per-layer scaling cannot see the layers: wrap with FullyShardedDataParallel(..., "
                            "use_orig_params=True) or fully_shard (FSDP2)")


def layout(param: torch.Tensor, grad: torch.Tensor, setting: str, who: str) -> str:
    """``"sharded"`` or ``"replicated"``: how ``param``'s gradient is spread over the ranks under
    the resolved ``distributed`` setting (module docstring)."""
    if isinstance(grad, DTensor):
        found = _dtensor_layout(grad, who)
        if found == "sharded" and setting == "replicated":
            raise ShardingError(f"{who}: distributed='replicated' but the gradients are sharded DTensors "
                                "(FSDP2 fully_shard): use distributed='auto' or 'sharded'")
        return found
    if setting in LAYOUTS:
        return setting
    return "sharded" if is_sharded_param(param) else "replicated"


def all_reduce_parts(parts: GradStats, num_groups: int) -> GradStats:
    """``parts`` holds ``2 * num_groups`` groups: the replicated gradients' statistics (groups
    ``0..G-1``) then the sharded ones' (``G..2G-1``). Returns the statistics of the whole gradient,
    the same on every rank, in two collectives and no host read: MAX over ranks of found_inf, the
    abs-max and the replicated sums and counts (replicas agree); SUM of the sharded sums and counts;
    each group's total is the replicated part plus the sharded part."""
    g = num_groups
    rep = {f.name: getattr(parts, f.name)[:g] for f in fields(parts)}
    sh = {f.name: getattr(parts, f.name)[g:] for f in fields(parts)}
    peak = torch.cat([torch.maximum(rep["found_inf"], sh["found_inf"]).double(),
                      torch.maximum(rep["absmax"], sh["absmax"]).double(),
                      *(rep[n].double() for n in ("sumsq", "zeros", "subnormals", "numel"))])
    summed = torch.cat([sh[n].double() for n in ("sumsq", "zeros", "subnormals", "numel")])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    p, s = peak.split(g), summed.split(g)
    return GradStats(p[0].float(), p[1].float(), (p[2] + s[0]).float(), (p[3] + s[1]).long(),
                     (p[4] + s[2]).long(), (p[5] + s[3]).long())


def all_reduce_(tensors: list[torch.Tensor], op: str) -> None:
    """SUM- or MAX-reduce ``tensors`` in place across the ranks of the default process group (one
    collective: packed into float64)."""
    if not tensors:
        return
    packed = torch.cat([t.double().reshape(-1) for t in tensors])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    for t, part in zip(tensors, packed.split([t.numel() for t in tensors])):
        t.copy_(part.reshape(t.shape).to(t.dtype))


def max_over_ranks_(t: torch.Tensor) -> torch.Tensor:
    """``t`` replaced in place by its maximum over the ranks of the default process group."""
    all_reduce_([t], "max")
    return t


def mean_over_ranks_(t: torch.Tensor) -> torch.Tensor:
    """``t`` replaced in place by its mean over the ranks of the default process group."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.div_(dist.get_world_size())
