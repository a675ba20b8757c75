"""Gradient fidelity: how close a step's mixed-precision gradient is to the fp32 gradient.

What loss scaling protects is the gradient, so the comparison measures it directly. On a probe
step, at the same weights, batch and dropout masks, :func:`probe` computes the fp32 reference
gradient of the same loss — autocast off, no layer-boundary transform (fp8 quantisation,
per-layer rescaling, measuring), a fresh graph differentiated with ``torch.autograd.grad`` — and
compares it with the step's *unscaled* mixed-precision gradient ``g`` (after ``unscale_``):

* ``cosine``    = <g, r> / (||g|| ||r||)  (1 = same direction; NaN when either is all zero);
* ``rel_err``   = ||g - r|| / ||r||;
* ``lost_frac`` = #{r != 0 and g == 0} / #{r != 0}: entries the low-precision backward flushed
  to zero although the fp32 gradient has them (underflow);

overall and per layer (the model's layers, :func:`strategies.model_layers.layers`; parameters
outside every layer are counted under ``"other"``). Training is unchanged: ``.grad``, the RNG
state and the module buffers (e.g. BatchNorm statistics) are left exactly as they were, so the
losses are bit-identical with the probe on or off. The probe's wall time is returned separately
(the loop keeps it out of step time and strategy overhead). One host read per probe.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from strategies.boundaries import Boundaries
from strategies.grad_compare import capture_rng, layer_of, layer_sums, restore_rng
from strategies.reference import fp32_loss

__all__ = ["capture_rng", "layer_of", "probe", "seconds"]


def _reference(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor],
               rng: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> list[torch.Tensor]:
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), Boundaries.of(model).disabled(), torch.enable_grad():
        restore_rng(rng, device)
        loss = fp32_loss(loss_fn, device.type, "fidelity probe")
        grads = torch.autograd.grad(loss.float().reshape(()), params, allow_unused=True)
    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(buffers[k])
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]


def probe(
    model: torch.nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    params: list[torch.nn.Parameter],
    rng: tuple[torch.Tensor, torch.Tensor | None],
    layer_names: dict[int, str] | None = None,
) -> dict[str, Any]:
    """Compare the parameters' current (unscaled) ``.grad`` with the fp32 gradient of ``loss_fn()``.

    ``loss_fn`` recomputes the step's loss (times the regime's multiplier, like the scaled
    backward) on the same batch; ``rng`` is :func:`capture_rng` from before the step's forward.
    Returns the fields of a ``kind: "fidelity"`` line (``experiments.schema.FIDELITY_FIELDS``)
    except ``kind`` and ``step``.
    """
    t0 = time.perf_counter()
    layer_names = layer_names if layer_names is not None else layer_of(model)
    with_grad = [p for p in params if p.grad is not None]
    device = with_grad[0].device if with_grad else torch.device("cpu")
    ref = _reference(model, loss_fn, with_grad, rng, device)
    order = list(dict.fromkeys(layer_names.get(id(p), "other") for p in with_grad))
    grads = [p.grad._values() if p.grad.is_sparse else p.grad for p in with_grad]
    index = [order.index(layer_names.get(id(p), "other")) for p in with_grad]
    sums = layer_sums(zip(grads, ref), index, len(order), device)  # per layer, strategies.grad_compare.LAYER_SUMS
    rows = sums.tolist()  # the probe's one host read
    total = [sum(col) for col in zip(*rows)] if rows else [0.0] * 6
    out: dict[str, Any] = _metrics(total)
    per_layer = {name: _metrics(row) for name, row in zip(order, rows)}
    for key in ("cosine", "rel_err", "lost_frac"):
        out[f"layer_{key}"] = {name: m[key] for name, m in per_layer.items()}
    finite = all(v == v and abs(v) != float("inf") for v in total[:4])
    out["skipped"] = not finite
    out["fidelity_probe_s"] = time.perf_counter() - t0
    return out


def seconds(row: dict[str, Any]) -> float:
    """The wall time of the probe that produced ``row``."""
    return float(row["fidelity_probe_s"])


def _metrics(s: list[float]) -> dict[str, float]:
    dot, gg, rr, dd, nz, lost = s
    nan = float("nan")
    return {
        "cosine": dot / (gg * rr) ** 0.5 if gg > 0 and rr > 0 else nan,
        "rel_err": (dd / rr) ** 0.5 if rr > 0 else nan,
        "lost_frac": lost / nz if nz > 0 else 0.0,
    }
