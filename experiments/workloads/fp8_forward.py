"""The simulated fp8 forward GEMMs: every ``nn.Linear``'s input activation and weight cast to fp8.

TransformerEngine's fp8 recipes (``transformer_engine/common/recipe/__init__.py``: ``Format.HYBRID``
= E4M3 in the forward pass, E5M2 in the backward; ``DelayedScaling``, ``Float8CurrentScaling``)
cast the two operands of each forward GEMM ``y = x W^T + b`` to E4M3 with a per-tensor scale:

    x_q = fp8(x * s_x) / s_x,    W_q = fp8(W * s_W) / s_W,    y = x_q W_q^T + b

with ``s`` from :class:`experiments.workloads.fp8.CastScaler` (``none``: 1; ``current``: ``fmt_max / amax(t)
/ 2^margin``; ``delayed``: the max of the same tensor's earlier abs-maxes, history 1024, margin 0 —
TE's ``DelayedScaling`` defaults), chosen per **role**: ``activation`` (the input ``x``) and
``weight`` (``W``); the ``gradient`` role is the backward quantiser of :mod:`experiments.workloads.precision`.

**Backward** — the cast is a straight-through estimator: ``d x_q / d x = 1`` and ``d W_q / d W = 1``,
while the GEMM's own backward uses the *quantised* operands it saved, ``dx = dy W_q`` and
``dW = dy^T x_q``. That is TE's default (``backward_override=None``): ``module/linear.py`` saves
the fp8 ``inputmat`` and ``weightmat`` for the dgrad and wgrad GEMMs (``high_precision`` would keep
the originals). Here autograd does it: ``F.linear`` saves ``x_q`` and ``W_q``.

Each Linear module (by its dotted name) has its own state per role. A forward with gradients on
adds its abs-max to the delayed histories; a forward without (evaluation) uses the scales and adds
nothing. Inside ``Boundaries.of(model).disabled()`` (the fp32 reference passes of the fidelity
probe and of ``norm_ratio``) nothing is cast. Simulation, not TE's kernels: the dequantised
operands go through the autocast dtype (bf16) into the matmul, which rounds ``q / s`` to 8 bits of
mantissa (relative 2^-9, below E4M3's 2^-4 step); TE multiplies the fp8 product by ``1 / (s_x s_W)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from experiments.workloads.fp8 import CastScaler
from strategies.boundaries import Boundaries

__all__ = ["FORWARD_ROLES", "LinearCasts", "straight_through"]

FORWARD_ROLES = ("activation", "weight")


class _StraightThrough(torch.autograd.Function):
    """``fn(x)`` forward, identity backward (the straight-through estimator)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def straight_through(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` whose gradient with respect to ``x`` is the incoming gradient unchanged."""
    return _StraightThrough.apply(x, fn)


class LinearCasts:
    """Casts the input and weight of every ``nn.Linear`` of ``model`` (module docstring).

    ``scalings`` maps each role of :data:`FORWARD_ROLES` to ``none | current | delayed``. The
    modules' ``forward`` is replaced on the instances (parameters, state dicts and hooks are
    untouched); :meth:`remove` restores it.
    """

    def __init__(self, model: nn.Module, fmt: torch.dtype, scalings: dict[str, str], history_len: int = 1024,
                 margin: int = 0) -> None:
        self.enabled = True
        self._boundaries = Boundaries.of(model)
        fmt_max = float(torch.finfo(fmt).max)
        self.scalers = {role: CastScaler(fmt, fmt_max, scalings[role], "nearest", history_len, margin)
                        for role in FORWARD_ROLES}
        self._modules = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not self._modules:
            raise ValueError(f"{type(model).__name__} has no nn.Linear to cast to fp8 (precision.forward_format)")
        for name, m in self._modules:
            m.forward = functools.partial(self._linear, name, m)  # type: ignore[method-assign]

    def cast(self, role: str, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (tensor ``name`` in ``role``) quantised-dequantised, straight-through backward."""
        if not self.enabled or self._boundaries.off:
            return t
        scaler, record = self.scalers[role], torch.is_grad_enabled()
        return straight_through(t, lambda x: scaler(name, x.detach(), record))

    def _linear(self, name: str, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.cast("activation", name, x), self.cast("weight", name, m.weight), m.bias)

    def remove(self) -> None:
        for _, m in self._modules:
            m.__dict__.pop("forward", None)
        self._modules.clear()
