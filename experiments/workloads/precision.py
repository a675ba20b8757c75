"""Precision modes and the layer-boundary hooks that simulate fp8 gradients and measure underflow.

Modes (``conf/precision/*.yaml``):

========== ================== ===================== =========== ===============
name       forward            activation gradients  max         smallest normal
========== ================== ===================== =========== ===============
fp32       float32            float32               3.4028e38   2^-126
fp16       autocast float16   float16 (real)        65504       2^-14
bf16       autocast bfloat16  bfloat16 (real)       3.3895e38   2^-126
fp8_e4m3   autocast bfloat16  bf16 -> e4m3fn -> bf16 448         2^-6
fp8_e5m2   autocast bfloat16  bf16 -> e5m2 -> bf16   57344       2^-14
fp8_hybrid autocast bfloat16  bf16 -> e5m2 -> bf16   57344       2^-14
========== ================== ===================== =========== ===============

``fp8_hybrid`` (TransformerEngine's ``Format.HYBRID``) also casts the forward: every ``nn.Linear``'s
input and weight go through E4M3 (``forward_format``; :mod:`experiments.workloads.fp8_forward`), and the cast
scaling is chosen per tensor role, ``cast_scaling_roles: {activation, weight, gradient}`` (the
gradient role is ``cast_scaling``, the backward quantiser below).

``fp16``/``bf16`` are ``torch.autocast`` on the configured device: on CPU as on CUDA, matmuls and
convolutions run in the low-precision type and their activation gradients are real fp16/bf16
tensors that really underflow (seed 001: the autocast op lists; seed 004: the dispatch).

FP8 is simulated: the forward runs under bf16 autocast, and at every layer boundary of the model
(``strategies.model_layers.layers(model)``) the gradient flowing backward is quantised and dequantised,
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
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from experiments.workloads.fp8 import CAST_SCALINGS, ROUNDINGS, CastScaler, quantize_dequantize
from experiments.workloads.fp8_forward import FORWARD_ROLES, LinearCasts
from strategies.boundaries import Boundaries, Trace
from strategies.model_layers import layers
from strategies import validation as v
from strategies.stats import exponent_histogram, fold_histogram, zeros_and_subnormals

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
NAMES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_hybrid")
ROLES = (*FORWARD_ROLES, "gradient")
FP8_CHECKS = {"cast_scaling": v.named(*CAST_SCALINGS), "rounding": v.named(*ROUNDINGS),
              "history_len": v.whole(1), "margin": v.whole(0)}
"""The fp8 quantiser's options (:mod:`experiments.workloads.fp8`), each with its check; their
defaults are :class:`Precision`'s."""


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
    ``max`` / ``smallest_normal``: the range of the format the activation gradients live in;
    ``cast_scaling`` (``none`` | ``current`` | ``delayed``, with ``history_len`` and ``margin``)
    and ``rounding`` (``nearest`` | ``stochastic``): the fp8 quantiser (:mod:`experiments.workloads.fp8`).
    ``forward_format``: the fp8 format of every ``nn.Linear``'s input and weight (``None`` = no
    forward cast), with the cast scalings ``activation_scaling`` and ``weight_scaling``
    (:mod:`experiments.workloads.fp8_forward`). ``cast_scaling_roles: {activation, weight, gradient}`` in
    the YAML sets the three (``gradient`` is ``cast_scaling``).
    """

    name: str
    autocast: torch.dtype | None
    grad_format: torch.dtype | None
    max: float
    smallest_normal: float
    cast_scaling: str = "none"
    rounding: str = "nearest"
    history_len: int = 1024
    margin: int = 0
    forward_format: torch.dtype | None = None
    activation_scaling: str = "none"
    weight_scaling: str = "none"

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
        fp8 = {f.name: cfg.get(f.name, f.default) for f in dataclasses.fields(cls) if f.name in FP8_CHECKS}
        forward_format = _dtype("forward_format", cfg.get("forward_format"))
        if forward_format is not None and forward_format not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"precision.forward_format must be float8_e4m3fn, float8_e5m2 or null, "
                             f"got {cfg.get('forward_format')!r}")
        roles = _roles(cfg)
        if "gradient" in roles:
            if "cast_scaling" in cfg and cfg["cast_scaling"] != roles["gradient"]:
                raise ValueError(f"precision.cast_scaling ({cfg['cast_scaling']!r}) and "
                                 f"precision.cast_scaling_roles.gradient ({roles['gradient']!r}) disagree; set one")
            fp8["cast_scaling"] = roles["gradient"]
        if forward_format is None and any(roles.get(r, "none") != "none" for r in FORWARD_ROLES):
            raise ValueError(f"precision.cast_scaling_roles.activation and .weight apply to modes with a "
                             f"forward_format only, not to {name}")
        for key, check in FP8_CHECKS.items():
            check(f"precision.{key}", fp8[key])
        if grad_format is None and (fp8["cast_scaling"] != "none" or fp8["rounding"] != "nearest"):
            raise ValueError(f"precision.cast_scaling and precision.rounding apply to the fp8 modes only, "
                             f"not to {name}")
        return cls(name, autocast, grad_format, mx, sn, **fp8, forward_format=forward_format,
                   activation_scaling=roles.get("activation", "none"), weight_scaling=roles.get("weight", "none"))

    def autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """``torch.autocast(device.type, dtype)`` for low-precision modes; a null context for fp32."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


def _roles(cfg: dict) -> dict[str, str]:
    """``precision.cast_scaling_roles`` checked: a mapping (or null) of roles to cast scalings."""
    roles = cfg.get("cast_scaling_roles")
    if roles is None:
        return {}
    if not isinstance(roles, dict) or not set(roles) <= set(ROLES):
        raise ValueError(f"precision.cast_scaling_roles must be null or a mapping with keys among "
                         f"{', '.join(ROLES)}, got {roles!r}")
    for role, scaling in roles.items():
        FP8_CHECKS["cast_scaling"](f"precision.cast_scaling_roles.{role}", scaling)
    return dict(roles)


class BoundaryHooks:
    """fp8 gradient simulation and per-layer measurements on the model's layer boundaries.

    Built on the one shared layer-boundary module (:mod:`strategies.boundaries`): the layers are
    ``strategies.model_layers.layers(model)``, the fp8 quantise–dequantise is its ``"quantize"``
    stage and the measurements its ``"observe"`` stage, so a per-layer strategy's rescaling
    (``"rescale"``) always comes first and the measurements see what the layer below receives,
    whatever the order in which the loop attached them.

    On a measuring step each boundary's gradient ``g`` is counted on the device as it arrives in
    backward (after fp8 quantisation): exact zeros, nonzero ``|g| < smallest_normal``, elements,
    and (when ``hist`` is on) a histogram of ``floor(log2|g|)`` over nonzero finite values
    (``torch.frexp``: ``g = m 2^e`` with ``0.5 <= |m| < 1``, so ``floor(log2|g|) = e - 1``).
    ``read()`` returns them as Python numbers — the only host sync, done on logging steps.
    """

    def __init__(self, model: nn.Module, precision: Precision, seed: int = 0) -> None:
        self.names: list[str] = layers(model)
        if not self.names:
            raise ValueError(f"{type(model).__name__} has no layer boundaries (no child module owns parameters)")
        self.precision = precision
        self.measure = False
        self.hist = False
        self.enabled = True
        self._stats: dict[str, list[torch.Tensor]] = {}
        self._hist: torch.Tensor | None = None
        self._hist_zeros: torch.Tensor | None = None
        modules = [model.get_submodule(name) for name in self.names]
        self._name_of = {id(m): name for name, m in zip(self.names, modules)}
        self._boundaries = Boundaries.of(model)
        self._handles = [self._boundaries.register(
            "observe", modules, on_grad=self._observe, when=lambda: self.enabled and self.measure)]
        if precision.grad_format is not None:
            quantize = CastScaler(precision.grad_format, precision.max, precision.cast_scaling, precision.rounding,
                                  precision.history_len, precision.margin, seed)
            self._handles.append(self._boundaries.register(
                "quantize", modules, on_grad=lambda trace, i, g: quantize(self._name_of[id(trace.calls[i])], g),
                when=lambda: self.enabled))
        self.forward_casts: LinearCasts | None = None
        if precision.forward_format is not None:
            self.forward_casts = LinearCasts(model, precision.forward_format, {
                "activation": precision.activation_scaling, "weight": precision.weight_scaling},
                precision.history_len, precision.margin)

    def _observe(self, trace: Trace, i: int, g: torch.Tensor) -> None:
        self._record(self._name_of[id(trace.calls[i])], g)

    def _record(self, name: str, g: torch.Tensor) -> None:
        g = g.detach()
        zeros, sub = zeros_and_subnormals([g], self.precision.smallest_normal)
        numel = torch.tensor(g.numel(), device=g.device)
        prev = self._stats.get(name)
        self._stats[name] = [zeros, sub, numel] if prev is None else [prev[0] + zeros, prev[1] + sub, prev[2] + numel]
        if self.hist:
            counts = fold_histogram(exponent_histogram(g), HIST_LO, HIST_BINS)
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
        """No transform at all inside — fp8, measuring, a per-layer strategy's rescaling: the
        fp32 reference passes (``norm_ratio``'s probe)."""
        prev, self.enabled = self.enabled, False
        try:
            with self._boundaries.disabled():
                yield
        finally:
            self.enabled = prev

    def remove(self) -> None:
        if self.forward_casts is not None:
            self.forward_casts.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
