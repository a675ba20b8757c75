"""Comparing a step's gradient with its fp32 reference: the pure-torch pieces the fidelity probe
(``experiments/app/fidelity.py``) and the doctor (``strategies/doctor/measure.py``) share.

* :func:`capture_rng` / :func:`restore_rng`: the RNG state a forward draws its dropout masks from
  (CPU, and the device's when it is CUDA), so a reference pass sees the same masks;
* :func:`layer_of`: which layer (:func:`strategies.model_layers.layers`) owns each parameter,
  ``"other"`` for those outside every layer;
* :func:`layer_sums`: per layer, in float64, ``<g, r>``, ``||g||^2``, ``||r||^2``,
  ``||g - r||^2``, ``#{r != 0}`` and ``#{r != 0 and g == 0}`` (the entries the low-precision
  backward lost), from which cosine, relative error and the lost fraction follow.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from strategies.model_layers import layers

__all__ = ["LAYER_SUMS", "RngState", "capture_rng", "layer_of", "layer_sums", "restore_rng"]

RngState = tuple[torch.Tensor, Optional[torch.Tensor]]

LAYER_SUMS = ("dot", "gg", "rr", "dd", "nonzero", "lost")
"""The columns of :func:`layer_sums`."""


def capture_rng(device: torch.device) -> RngState:
    """The RNG state the next forward pass will draw dropout masks from (call it before that pass)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_rng(state: RngState, device: torch.device) -> None:
    """Set the RNG state :func:`capture_rng` returned (inside ``torch.random.fork_rng`` to keep the caller's)."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def layer_of(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> layer name`` for every parameter of ``model``."""
    out: dict[int, str] = {}
    for name in layers(model):
        for p in model.get_submodule(name).parameters():
            out.setdefault(id(p), name)
    for p in model.parameters():
        out.setdefault(id(p), "other")
    return out


def layer_sums(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], index: Iterable[int], n_layers: int,
               device: torch.device) -> torch.Tensor:
    """``[n_layers, 6]`` float64 sums of :data:`LAYER_SUMS` over the ``(g, r)`` pairs, pair ``i``
    added to row ``index[i]``; on the device, no host read."""
    sums = torch.zeros(n_layers, len(LAYER_SUMS), dtype=torch.float64, device=device)
    with torch.no_grad():
        for k, (g, r) in zip(index, pairs):
            g, r = g.double(), r.double()
            nz = r != 0
            sums[k] += torch.stack([(g * r).sum(), g.square().sum(), r.square().sum(), (g - r).square().sum(),
                                    nz.sum().double(), (nz & (g == 0)).sum().double()])
    return sums
