"""The simulated block-scaled GEMMs: every ``nn.Linear``'s forward and backward operands cast with
a block-scaled recipe (``precision=mxfp8 | fp8_blockwise | nvfp4``; :mod:`experiments.workloads.block_config`).

A Linear ``y = x W^T + b`` runs three GEMMs, and each quantises its two operands with blocks
along the dim it contracts (TE ``docs/features/low_precision_training``: the row-wise and
column-wise copies; torchao ``mx_formats/mx_linear.py``, ``mx_mm``), ``Q`` being
:func:`strategies.blocks.quantize` (dequantised, fp32) with the role's recipe:

* forward (fprop): ``y = Q_a(x, dim=-1) Q_w(W, dim=-1)^T + b``;
* input gradient (dgrad): ``dx = Q_g(dy, dim=-1) Q_w(W, dim=-2)``;
* weight gradient (wgrad): ``dW = Q_g'(dy, dim=-2)^T Q_a'(x, dim=-2)`` (tokens flattened to the
  first dim; ``'``: the column-wise recipe, NVFP4 with the RHT where configured);
* ``db = sum_tokens dy`` from the unquantised ``dy`` (TE fuses the bias gradient into the cast).

The GEMMs run in fp32 with autocast off (the fp32 accumulation of the tensor cores); the output is
cast to the autocast dtype when autocast is on (bf16: TE's output dtype), else to ``x``'s dtype. A
non-finite element passes through unquantised, so a loss scaler still sees an overflow (the FP8
blockwise kernel would saturate it to a finite value). Stochastic rounding draws from one
generator of the run's own (seeded with the run's seed, on the model's device), in the order above.
Linears whose name matches ``keep`` (fnmatch) run as plain ``F.linear`` under autocast: the layers
the NVFP4 paper (arXiv 2509.25149, section 4) keeps in BF16.

On a measuring step each cast's :func:`strategies.blocks.block_stats` is accumulated per layer and
role (both copies of a role together); :meth:`BlockLinears.read` returns the shares and the
scale-exponent histogram (the only host sync, at the logging interval).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from experiments.workloads.block_config import BLOCK_ROLES, BlockSpec
from strategies.blocks import SCALE_EXP_MIN, block_stats, quantize
from strategies.boundaries import Boundaries

__all__ = ["STAT_KEYS", "BlockLinears", "block_linear"]

STAT_KEYS = ("clipped_share", "clip_error_share", "flushed_share", "zero_scale_share")
"""The shares :meth:`BlockLinears.read` reports per layer and role (:func:`strategies.blocks.block_stats`)."""


class _BlockLinear(torch.autograd.Function):
    """``y = x W^T + b`` with block-quantised operands in all three GEMMs (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,  # type: ignore[override]
                cast: Callable[..., torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(cast("activation", x2, -1), cast("weight", w.float(), -1), None if b is None else b.float())
        ctx.save_for_backward(x2, w)
        ctx.cast, ctx.x_shape, ctx.x_dtype, ctx.has_bias = cast, x.shape, x.dtype, b is not None
        return y.reshape(*x.shape[:-1], -1).to(out_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, w = ctx.saved_tensors
        cast = ctx.cast
        dy2 = dy.reshape(-1, dy.shape[-1]).float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (cast("gradient", dy2, -1) @ cast("weight", w.float(), -2)).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            g_c = cast("gradient", dy2, -2, columnwise=True)
            dw = (g_c.t() @ cast("activation", x2, -2, columnwise=True)).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def block_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cast: Callable[..., torch.Tensor],
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The block-scaled Linear; ``cast(role, t, dim, columnwise=False)`` quantises one operand."""
    return _BlockLinear.apply(x, w, b, cast, out_dtype)


class BlockLinears:
    """Replaces the ``forward`` of every ``nn.Linear`` of ``model`` not matched by ``spec.keep``
    (module docstring); :meth:`remove` restores them. ``measuring()`` says whether to record the
    block statistics of the casts now (the hooks' logging-step flag)."""

    def __init__(self, model: nn.Module, spec: BlockSpec, seed: int = 0,
                 measuring: Callable[[], bool] = lambda: False) -> None:
        self.spec, self.enabled, self.measuring = spec, True, measuring
        self._boundaries = Boundaries.of(model)
        self._seed = seed
        self._generator: torch.Generator | None = None
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError(f"{type(model).__name__} has no nn.Linear to cast (precision.blocks)")
        for pattern in spec.keep:
            if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in linears):
                raise ValueError(f"precision.blocks.keep pattern {pattern!r} matches no Linear; Linears: "
                                 f"{', '.join(name for name, _ in linears)}")
        self.kept = [name for name, _ in linears if any(fnmatch.fnmatchcase(name, p) for p in spec.keep)]
        self._modules = [(name, m) for name, m in linears if name not in self.kept]
        self._stats: dict[tuple[str, str], list[torch.Tensor]] = {}
        for name, m in self._modules:
            m.forward = functools.partial(self._linear, name, m)  # type: ignore[method-assign]

    def _gen(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self._seed)
        return self._generator

    def cast(self, name: str, role: str, t: torch.Tensor, dim: int, columnwise: bool = False) -> torch.Tensor:
        """``t`` (fp32, 2-d) of layer ``name`` in ``role`` quantised-dequantised along ``dim``."""
        recipe = (self.spec.columnwise if columnwise else self.spec.rowwise)[role]
        gen = self._gen(t.device) if getattr(recipe, "rounding", "nearest") == "stochastic" else None
        q = quantize(t, recipe, dim=dim, generator=gen)
        if self.measuring():
            self._record(name, role, q)
        return torch.where(torch.isfinite(t), q.dequantized, t)

    def _linear(self, name: str, m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self._boundaries.off:
            return F.linear(x, m.weight, m.bias)
        dev = x.device.type
        out = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return block_linear(x, m.weight, m.bias, functools.partial(self.cast, name), out)

    def _record(self, name: str, role: str, q) -> None:  # q: strategies.blocks.BlockQuantized
        s = block_stats(q)
        n, nz = s["blocks"].double(), q.nonzero.sum(dtype=torch.float64)
        counts = torch.stack([n, nz, *(s[k].double() * (nz if k == "flushed_share" else n) for k in STAT_KEYS)])
        prev = self._stats.get((name, role))
        self._stats[(name, role)] = [counts, s["scale_exp_hist"]] if prev is None else [
            prev[0] + counts, prev[1] + s["scale_exp_hist"]]

    def reset(self) -> None:
        """Forget the statistics of the previous logging step."""
        self._stats.clear()

    def read(self) -> dict[str, dict[str, dict]]:
        """``{layer: {role: {"blocks", "clipped_share", "clip_error_share", "flushed_share",
        "zero_scale_share", "scale_exp_hist": {"lo", "counts"}}}}`` over the casts since
        :meth:`reset` (empty when nothing was measured); the histogram trimmed to its nonzero bins."""
        if not self._stats:
            return {}
        keys = list(self._stats)
        counts = torch.stack([self._stats[k][0] for k in keys]).cpu().tolist()
        hists = torch.stack([self._stats[k][1] for k in keys]).cpu()
        out: dict[str, dict[str, dict]] = {}
        for (name, role), c, h in zip(keys, counts, hists):
            n, nz = c[0], c[1]
            row = {"blocks": int(n)}
            row.update({k: v / max(nz if k == "flushed_share" else n, 1.0) for k, v in zip(STAT_KEYS, c[2:])})
            idx = torch.nonzero(h).flatten()
            lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
            row["scale_exp_hist"] = {"lo": SCALE_EXP_MIN + lo, "counts": h[lo:hi].tolist()}
            out.setdefault(name, {})[role] = row
        return {name: {r: out[name][r] for r in BLOCK_ROLES if r in out[name]} for name in out}

    def remove(self) -> None:
        for _, m in self._modules:
            m.__dict__.pop("forward", None)
        self._modules.clear()
