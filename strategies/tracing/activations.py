"""The forward activation abs-max of every step, kept on the device: forward hooks on a model's leaf modules.

An fp16 forward overflows when an activation passes the format's largest finite value (65504): the
output of that module turns ``inf`` (or ``NaN``), the loss follows, and the gradients can never
show it beforehand. Its precursor is in the forward itself: the activation abs-max climbing toward
the format's max, i.e. the *headroom* ``log2(max / amax)`` (binades left before the overflow)
shrinking. :class:`ForwardAbsMax` measures it, per step, without a host read:

* every leaf module (no children) gets a forward hook; an output (or each tensor of a tuple output)
  of the forward's low-precision dtype (``dtype``, e.g. ``torch.float16`` under fp16 autocast), made
  with autograd on (a training forward, not an evaluation under ``no_grad``), updates that module's
  slot of a device vector: ``slot = max(slot, max |out|)`` over the output's *finite* entries (an
  attention mask's ``-inf`` is no activation; an overflow itself shows in the step's ``found_inf``
  and its loss, and the values next to it are what nears the format's max);
* :meth:`take` returns the step's abs-max over the modules and the index of the module that holds
  it (device tensors) and zeroes the slots for the next step. Outputs in fp32 (an fp32 reference
  pass, a LayerNorm under autocast) are not the low-precision forward's and are left out.

Cost: per training forward, an ``abs``, an in-place ``nan_to_num`` and an ``amax`` over each leaf
module's output, and one ``max`` per step: +2.8% of the step time on the 2-layer character GPT
on a CPU (best of three runs each way, ``docs/run-records.md``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ForwardAbsMax", "leaf_modules", "not_recorded"]


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's leaf modules (no children), by name (``model.named_modules()``'s, shared ones once)."""
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if next(m.children(), None) is None]


def not_recorded(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation columns of a step without a recorded forward: NaN and module index -1."""
    return torch.full((), math.nan, device=device), torch.full((), -1.0, device=device)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


class ForwardAbsMax:
    """Per-step abs-max of a model's low-precision forward activations (module docstring).

    Args:
        model: the trained model (its leaf modules are hooked).
        dtype: the forward's low-precision dtype (``torch.float16``, ``torch.bfloat16``); its
            ``torch.finfo(dtype).max`` is :attr:`max`, the value the headroom is measured against.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point or torch.finfo(dtype).bits > 16:
            raise ValueError(f"ForwardAbsMax dtype must be a 16-bit or narrower float, got {dtype}")
        self.dtype = dtype
        self.max = float(torch.finfo(dtype).max)
        leaves = leaf_modules(model)
        self.names = [name for name, _ in leaves]
        self._slots: torch.Tensor | None = None
        self._seen = False
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(leaves)]

    def _hook(self, i: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for t in _tensors(output):
                if t.dtype != self.dtype or t.numel() == 0:
                    continue
                with torch.no_grad():
                    a = t.detach().abs().nan_to_num_(0.0, 0.0, 0.0)  # finite entries only: a mask's -inf is no activation
                    v = a.amax().float()
                    if self._slots is None or self._slots.device != v.device:
                        self._slots = torch.zeros(len(self.names), device=v.device)
                    slot = self._slots[i]
                    slot.copy_(torch.maximum(slot, v))
                self._seen = True
        return hook

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (finite) abs-max of this step's hooked outputs and the index of its module (as float32
        device scalars; NaN and -1 when no low-precision output was seen), the slots zeroed for the next step."""
        if not self._seen or self._slots is None:
            return not_recorded(device)
        amax, index = self._slots.max(dim=0)
        out = amax.to(device, torch.float32), index.to(device, torch.float32)
        self._slots.zero_()
        self._seen = False
        return out

    def reset(self) -> None:
        """Forget what the hooks saw since the last :meth:`take` (e.g. a diagnostic re-run of a batch)."""
        if self._slots is not None:
            self._slots.zero_()
        self._seen = False

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []
