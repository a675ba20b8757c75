"""The fp32 reference probe of ``norm_ratio``/``hybrid`` on sharded parameters (FSDP2, FSDP1).

Under FSDP a rank holds only a shard of each parameter; the forward gathers the whole one and the
backward reduce-scatters its gradient (averaged over the ranks) into the shard's ``.grad``. The
gradient of a loss with respect to the shards is therefore not ``torch.autograd.grad(loss,
shards)`` (the shards are not in the graph; FSDP1's hooks would even fire on that backward and
write into the training gradients): it is what FSDP's own backward writes into ``.grad``.

:func:`wrapped_reference_sumsq` runs that backward for the reference: it sets aside the
(mixed-precision, already unscaled) gradient of every parameter the backward may write to, runs
``closure().backward()`` with autocast disabled (checked to be fp32, :func:`strategies.reference.fp32_loss`),
reads the fp32 reference gradients FSDP wrote — averaged over the ranks exactly as the training
gradient is, and sharded the same way — then puts every training gradient back. The result is
this rank's part of ``||g_fp32||^2`` over the probed parameters; the caller SUM-reduces it.

The closure must call the FSDP-wrapped model (its root), and every parameter it reaches must be
among the ones set aside: the attached model's (``attach(model)`` with the wrapped model), the
reference's ``params`` and the optimizer's. FSDP1's ``use_orig_params=True`` gradients are views
of the flat gradient, which FSDP zeroes in place before the reference backward: they are set
aside as copies.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from strategies.reference import fp32_loss
from strategies.sharding import local

__all__ = ["is_wrapped", "wrapped_reference_sumsq"]


def is_wrapped(param: torch.Tensor) -> bool:
    """Whether ``param`` is FSDP-managed (an FSDP2 DTensor parameter, or FSDP1's flat parameter or
    one of its views): its gradient comes from FSDP's backward, not from ``autograd.grad``."""
    return isinstance(param, DTensor) or bool(getattr(param, "_fsdp_flattened", False))


def wrapped_reference_sumsq(closure: Callable[[], torch.Tensor], probed: list[torch.Tensor],
                            touched: Iterable[torch.Tensor], device: torch.device, who: str) -> torch.Tensor:
    """This rank's ``sum ||g_ref||^2`` over the local shards of ``probed`` (float32 on ``device``),
    from ``closure().backward()`` with the gradients of ``touched`` (and of ``probed``) set aside
    and restored (module docstring). Raises ``ValueError`` when the backward gave no probed
    parameter a gradient on any rank's part (the closure did not run the wrapped model)."""
    aside: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for p in [*probed, *touched]:
        if id(p) not in aside:
            g = p.grad
            aside[id(p)] = (p, g.clone() if g is not None and getattr(p, "_fsdp_flattened", False) else g)
    try:
        for p, _ in aside.values():
            p.grad = None
        with torch.enable_grad():
            loss = fp32_loss(closure, device.type, who)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"{who}: the reference closure must return a scalar loss tensor")
            loss.float().reshape(()).backward()
        reached = [p.grad for p in probed if p.grad is not None]
        if not reached and any(local(p).numel() for p in probed):
            raise ValueError(f"{who}: the fp32 reference gave the sharded (FSDP) parameters no gradient: under FSDP "
                             "the reference closure must call the FSDP-wrapped model, not the plain module")
        sq = [local(g).detach().float().square().sum().to(device) for g in reached]
        return torch.stack(sq).sum() if sq else torch.zeros((), device=device)
    finally:
        for p, g in aside.values():
            p.grad = g
