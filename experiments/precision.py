"""Precision modes and the layer-boundary hooks that simulate fp8 gradients and measure underflow.

Modes (``conf/precision/*.yaml``):

======== ================== ===================== =========== ===============
name     forward            activation gradients  max         smallest normal
======== ================== ===================== =========== ===============
fp32     float32            float32               3.4028e38   2^-126
fp16     autocast float16   float16 (real)        65504       2^-14
bf16     autocast bfloat16  bfloat16 (real)       3.3895e38   2^-126
fp8_e4m3 autocast bfloat16  bf16 -> e4m3fn -> bf16 448         2^-6
fp8_e5m2 autocast bfloat16  bf16 -> e5m2 -> bf16   57344       2^-14
======== ================== ===================== =========== ===============

``fp16``/``bf16`` are ``torch.autocast`` on the configured device: on CPU as on CUDA, matmuls and
convolutions run in the low-precision type and their activation gradients are real fp16/bf16
tensors that really underflow (seed 001: the autocast op lists; seed 004: the dispatch).

FP8 is simulated: the forward runs under bf16 autocast, and at every layer boundary of the model
(``model.boundaries``) the gradient flowing backward is quantised and dequantised,
``g <- float(fp8(g))``, by ``torch``'s own casts to ``torch.float8_e4m3fn`` / ``float8_e5m2``
(round to nearest even; values below half the smallest subnormal — 2^-10 for e4m3, 2^-17 for
e5m2 — become 0). Overflow follows the formats as torch casts them, checked on torch 2.13:

* ``float8_e5m2`` has infinities: a finite value that rounds above 57344 becomes ``±inf``
  (torch's cast already does this), so an overflow reaches the loss scaler as a non-finite
  gradient, exactly as in real e5m2 training.
* ``float8_e4m3fn`` has no infinity: torch's cast *saturates* finite values to ``±448`` (the
  "satfinite" conversion Transformer Engine uses) — a silently clipped gradient, which is the
  real hazard of e4m3. Non-finite inputs (an overflow upstream, already ``inf``/``nan`` in bf16)
  are passed through unchanged rather than clamped to 448 (torch's cast would clamp ``inf``), so
  the scaler still sees them and can skip the step.

Measuring is on only for logging steps (``BoundaryHooks.measure``); otherwise a hook only checks
a flag, and with neither fp8 nor measuring the hooks return immediately.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Precision", "BoundaryHooks", "quantize_dequantize", "HIST_LO", "HIST_BINS"]

HIST_LO = -64  # exponent of the histogram's first bin (floor(log2|g|) below it is clamped in)
HIST_BINS = 96  # bins cover exponents -64 .. 31; larger ones are clamped into the last bin

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
NAMES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def _dtype(field: str, name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"precision.{field} must be one of {', '.join(_DTYPES)} or null, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class Precision:
    """One precision mode, built from ``conf/precision/<name>.yaml``.

    ``autocast``: the forward's autocast dtype (``None`` = plain fp32); ``grad_format``: the fp8
    format activation gradients are quantised to at layer boundaries (``None`` = no simulation);
    ``max`` / ``smallest_normal``: the range of the format the activation gradients live in.
    """

    name: str
    autocast: torch.dtype | None
    grad_format: torch.dtype | None
    max: float
    smallest_normal: float

    @classmethod
    def from_config(cls, cfg: dict) -> "Precision":
        name = cfg.get("name")
        if name not in NAMES:
            raise ValueError(f"precision.name must be one of {', '.join(NAMES)}, got {name!r}")
        autocast = _dtype("autocast", cfg.get("autocast"))
        if autocast is not None and autocast not in (torch.float16, torch.bfloat16):
            raise ValueError(f"precision.autocast must be float16, bfloat16 or null, got {cfg.get('autocast')!r}")
        grad_format = _dtype("grad_format", cfg.get("grad_format"))
        if grad_format is not None and grad_format not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"precision.grad_format must be float8_e4m3fn, float8_e5m2 or null, got {cfg.get('grad_format')!r}"
            )
        mx, sn = float(cfg.get("max", 0.0)), float(cfg.get("smallest_normal", 0.0))
        if not (mx > 0 and 0 < sn < mx):
            raise ValueError(f"precision.max and precision.smallest_normal must satisfy 0 < smallest_normal < max, got {sn}, {mx}")
        return cls(name, autocast, grad_format, mx, sn)

    def autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """``torch.autocast(device.type, dtype)`` for low-precision modes; a null context for fp32."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


def quantize_dequantize(g: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``g`` rounded to the fp8 format ``fmt`` and cast back to ``g.dtype``.

    e5m2 overflows to ``±inf`` (torch's cast); e4m3fn saturates finite values at ``±448``
    (torch's cast) while non-finite inputs are kept (see the module docstring).
    """
    q = g.to(fmt).to(g.dtype)
    if fmt == torch.float8_e4m3fn:
        q = torch.where(torch.isfinite(g), q, g)
    return q


class _QuantGrad(torch.autograd.Function):
    """Identity in forward; quantise–dequantise the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.fmt = fmt
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return quantize_dequantize(g, ctx.fmt), None


class BoundaryHooks:
    """Forward hooks on ``model.boundaries``: fp8 gradient simulation and per-layer measurements.

    On a measuring step each boundary output gets a tensor hook that, when its gradient ``g``
    arrives in backward (after fp8 quantisation, i.e. what the layer below receives), accumulates
    on the device: the count of exact zeros, the count of nonzero ``|g| < smallest_normal``, the
    element count, and (when ``hist`` is on) a histogram of ``floor(log2|g|)`` over nonzero finite
    values (``torch.frexp``: ``g = m 2^e`` with ``0.5 <= |m| < 1``, so ``floor(log2|g|) = e - 1``).
    ``read()`` returns them as Python numbers — the only host sync, done on logging steps.
    """

    def __init__(self, model: nn.Module, precision: Precision) -> None:
        names = getattr(model, "boundaries", None)
        if not names:
            raise ValueError(f"{type(model).__name__} does not declare `boundaries` (layer-boundary module names)")
        self.names: list[str] = list(names)
        self.precision = precision
        self.measure = False
        self.hist = False
        self.enabled = True
        self._stats: dict[str, list[torch.Tensor]] = {}
        self._hist: torch.Tensor | None = None
        self._hist_zeros: torch.Tensor | None = None
        self._handles = [
            model.get_submodule(name).register_forward_hook(self._make_hook(name)) for name in self.names
        ]

    def _make_hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self.enabled or not torch.is_grad_enabled() or not output.requires_grad:
                return None
            if self.measure:
                output.register_hook(lambda g: self._record(name, g))
            if self.precision.grad_format is not None:
                return _QuantGrad.apply(output, self.precision.grad_format)
            return None

        return hook

    def _record(self, name: str, g: torch.Tensor) -> None:
        g = g.detach()
        zeros = (g == 0).sum()
        sub = ((g != 0) & (g.abs() < self.precision.smallest_normal)).sum()
        numel = torch.tensor(g.numel(), device=g.device)
        prev = self._stats.get(name)
        self._stats[name] = [zeros, sub, numel] if prev is None else [prev[0] + zeros, prev[1] + sub, prev[2] + numel]
        if self.hist:
            flat = g.float().flatten()
            keep = (flat != 0) & torch.isfinite(flat)
            exps = torch.frexp(flat[keep]).exponent.to(torch.int64) - 1
            idx = (exps - HIST_LO).clamp_(0, HIST_BINS - 1)
            counts = torch.bincount(idx, minlength=HIST_BINS)
            self._hist = counts if self._hist is None else self._hist + counts
            self._hist_zeros = zeros if self._hist_zeros is None else self._hist_zeros + zeros

    def reset(self) -> None:
        """Forget the measurements of the previous logging step."""
        self._stats.clear()
        self._hist = None
        self._hist_zeros = None

    def read(self) -> dict:
        """``{"act_zero_frac": {layer: f}, "act_subnormal_frac": {layer: f}, "act_exp_hist": ...}``.

        Layers whose gradient never arrived (e.g. the step produced none) are left out.
        """
        out: dict = {"act_zero_frac": {}, "act_subnormal_frac": {}}
        if self._stats:
            names = [n for n in self.names if n in self._stats]
            stacked = torch.stack([torch.stack(self._stats[n]) for n in names]).cpu().tolist()
            for name, (z, s, n) in zip(names, stacked):
                out["act_zero_frac"][name] = z / max(n, 1)
                out["act_subnormal_frac"][name] = s / max(n, 1)
        if self._hist is not None:
            out["act_exp_hist"] = {
                "lo": HIST_LO,
                "counts": self._hist.cpu().tolist(),
                "zeros": int(self._hist_zeros.item()) if self._hist_zeros is not None else 0,
            }
        return out

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """No quantisation and no measuring inside (the fp32 reference pass of ``norm_ratio``)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
