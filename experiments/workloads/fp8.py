"""The simulated fp8 quantiser of activation gradients: per-tensor cast scaling and rounding.

At every layer boundary (``strategies.boundaries``, stage ``"quantize"``) the gradient ``g`` is
quantised to an fp8 format and dequantised. With per-tensor **cast scaling** (TransformerEngine's
recipes, ``transformer_engine/common/recipe/__init__.py``) it is multiplied by a scale ``s``
before the cast and divided by it after, so ``q = fp8(g * s) / s``:

* ``none``    — ``s = 1`` (the loss scale alone places the values);
* ``current`` — ``s = fmt_max / amax(g) / 2^margin`` with the abs-max of the tensor cast now
  (TE's current scaling);
* ``delayed`` — ``s = fmt_max / max(history) / 2^margin``, the history being the abs-maxes of
  the last ``history_len`` gradients of the same layer (before this one; TE's ``DelayedScaling``
  with ``amax_compute_algo="max"``); this gradient's abs-max joins the history afterwards
  (unless the call says ``record=False``: an evaluation forward uses the scale, adds nothing).

``s`` stays 1 while the abs-max is 0 or non-finite (nothing to place, or an overflow that the
loss scaler must see as it is). **Rounding** is ``nearest`` (torch's cast: round to nearest
even) or ``stochastic``: ``x`` rounds to one of its two fp8 neighbours with probability
proportional to its distance from the other, so ``E[q] = x`` (unbiased), using a generator of
its own so the training RNG stream is not touched. All on the device, no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["CAST_SCALINGS", "ROUNDINGS", "CastScaler", "quantize_dequantize", "stochastic_round"]

CAST_SCALINGS = ("none", "current", "delayed")
ROUNDINGS = ("nearest", "stochastic")
_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}


def quantize_dequantize(g: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``g`` rounded to the fp8 format ``fmt`` and cast back to ``g.dtype``.

    e5m2 overflows to ``±inf`` (torch's cast); e4m3fn saturates finite values at ``±448``
    (torch's cast) while non-finite inputs are kept, so the loss scaler still sees them.
    """
    q = g.to(fmt).to(g.dtype)
    if fmt == torch.float8_e4m3fn:
        q = torch.where(torch.isfinite(g), q, g)
    return q


def stochastic_round(g: torch.Tensor, fmt: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """``g`` rounded stochastically onto the grid of ``fmt`` (then cast through it, as
    :func:`quantize_dequantize`): the spacing at ``|x|`` is ``2^(e - m)`` with ``e`` the exponent
    of ``x`` (at least the format's smallest normal exponent: subnormals share its spacing)."""
    x = g.float()
    _, e = torch.frexp(x)  # x = f 2^e, 0.5 <= |f| < 1: the exponent of |x| is e - 1
    e = torch.clamp(e - 1, min=_MIN_NORMAL_EXP[fmt])
    ulp = torch.ldexp(torch.ones_like(x), e - _MANTISSA[fmt])
    u = torch.rand(x.shape, generator=generator, device=x.device)
    down = torch.floor(x / ulp) * ulp
    r = torch.where(u < (x - down) / ulp, down + ulp, down)
    r = torch.where(torch.isfinite(x), r, x)
    return quantize_dequantize(r.to(g.dtype), fmt)


class CastScaler:
    """Per-layer cast scaling and rounding state of one run (see the module docstring)."""

    def __init__(self, fmt: torch.dtype, fmt_max: float, cast_scaling: str = "none", rounding: str = "nearest",
                 history_len: int = 1024, margin: int = 0, seed: int = 0) -> None:
        self.fmt, self.fmt_max = fmt, float(fmt_max)
        self.cast_scaling, self.rounding = cast_scaling, rounding
        self.history_len, self.margin = int(history_len), int(margin)
        self.seed = seed
        self._history: dict[str, torch.Tensor] = {}
        self._generator: torch.Generator | None = None

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        s = self.fmt_max / amax / 2.0**self.margin
        return torch.where(torch.isfinite(amax) & (amax > 0) & torch.isfinite(s), s, torch.ones_like(s))

    def __call__(self, layer: str, g: torch.Tensor, record: bool = True) -> torch.Tensor:
        """``g`` quantised and dequantised with the cast scale of tensor ``layer``; with ``record``
        (the default) its abs-max joins that tensor's delayed-scaling history."""
        amax = g.detach().abs().amax().float()
        if self.cast_scaling == "current":
            s = self._scale(amax)
        elif self.cast_scaling == "delayed":
            hist = self._history.get(layer)
            if hist is None:
                hist = self._history[layer] = torch.zeros(self.history_len, device=g.device)
            s = self._scale(hist.amax())
            finite = torch.isfinite(amax) & record
            hist.copy_(torch.where(finite, torch.cat([amax.reshape(1), hist[:-1]]), hist))  # roll in, newest first
        else:
            s = None
        x = g if s is None else (g.float() * s).to(g.dtype)
        if self.rounding == "stochastic":
            if self._generator is None or self._generator.device != g.device:
                self._generator = torch.Generator(device=g.device).manual_seed(self.seed)
            q = stochastic_round(x, self.fmt, self._generator)
        else:
            q = quantize_dequantize(x, self.fmt)
        return q if s is None else (q.float() / s).to(g.dtype)
