"""What the doctor's hooks see in one pass over a step (``strategies.doctor`` decides from it;
its docstring states the method and the sources).

* Forward hooks on every module (with keyword arguments: HF passes every input by keyword) find
  the first one whose finite inputs give a non-finite output that its fp32 recomputation (the
  same call, positional and keyword arguments in float32) does not have (so a ``-inf`` attention
  mask is no overflow); in an fp32 pass, the first NaN made from NaN-free inputs. A key-value
  cache argument (transformers' ``Cache``, which the call already appended this step's keys to)
  is passed as ``None`` to the recomputation, so it attends to the call's own keys once.
* Full backward hooks on the leaf modules record each module's output- and input-gradient
  abs-max, the backward order, and the first module whose finite output gradient gives a
  non-finite input gradient; :func:`first_backward` adds the owners of non-finite parameter
  gradients.
* :func:`backward_value` and :func:`safe_scale` read the magnitudes an fp32 pass recorded.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Record", "backward_value", "first_backward", "hooks", "safe_scale"]


def _finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(obj)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _has_nan(obj: Any) -> bool:
    return any(bool(torch.isnan(t).any()) for t in tree_leaves(obj)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _absmax(obj: Any) -> float:
    vals = [float(t.detach().abs().max()) for t in tree_leaves(obj)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return max(vals, default=0.0)


def _kv_cache(obj: Any) -> bool:
    """A key-value cache (transformers' ``Cache``: ``update`` and ``get_seq_length``)."""
    return callable(getattr(obj, "update", None)) and callable(getattr(obj, "get_seq_length", None))


def _wide(obj: Any) -> Any:
    """``obj`` for the fp32 recomputation: floating tensors in float32, key-value caches None."""
    if _kv_cache(obj):
        return None
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    return tree_map(_wide, obj) if isinstance(obj, (list, tuple, dict)) else obj


def _out_of_range(low: Any, wide: Any) -> tuple[float, bool]:
    """Compare a low-precision output with its fp32 recomputation: ``(value, new)`` where ``new``
    says the low-precision output has non-finite entries the fp32 one lacks, and ``value`` is the
    largest fp32 magnitude at those entries (``inf`` when fp32 is non-finite there too)."""
    value, new = 0.0, False
    for a, b in zip(tree_leaves(low), tree_leaves(wide)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()):
            continue
        bad = ~torch.isfinite(a)
        if b.shape != a.shape:
            new = new or bool(bad.any())
            continue
        fresh = bad & torch.isfinite(b)
        if bool(fresh.any()):
            new = True
            value = max(value, float(b[fresh].abs().max()))
        elif bool((bad & torch.isnan(a) & ~torch.isnan(b)).any()):
            new, value = True, float("inf")
    return value, new


@dataclass
class Record:
    """What the hooks saw in one pass."""

    forward_first: tuple[str, str, float] | None = None  # module, tensor, fp32 value
    backward_first: tuple[str, str] | None = None
    grad_absmax: dict[str, float] = field(default_factory=dict)  # module -> max |output gradient|
    grad_in_absmax: dict[str, float] = field(default_factory=dict)  # module -> max |input gradient|
    backward_order: list[str] = field(default_factory=list)  # leaf modules in backward (hook) order
    backward_on: bool = False
    wide: bool = False  # an fp32 pass: blame the first NaN made from NaN-free inputs instead
    busy: bool = False  # inside a recomputation: the hooks stay quiet


@contextlib.contextmanager
def hooks(model: torch.nn.Module, rec: Record, device_type: str) -> Iterator[None]:
    """Forward hooks on every module and full backward hooks on every leaf module, feeding ``rec``."""
    handles = []
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

    def forward(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if rec.forward_first is not None or rec.busy:
            return
        inputs = (args, kwargs)
        if rec.wide:
            if _has_nan(output) and not _has_nan(inputs):
                name = names[id(module)]
                rec.forward_first = (name, f"{name} output", float("nan"))
            return
        if _finite(output) or not _finite(inputs):
            return
        # Candidate: finite inputs, non-finite output. Recompute it in fp32 from the same inputs;
        # intentional infinities (a -inf attention mask) are there in fp32 too and do not count.
        name = names[id(module)]
        rec.busy = True
        try:
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                wide = module(*_wide(tuple(args)), **_wide(dict(kwargs)))
        except Exception:  # noqa: BLE001 - a module that cannot be re-called: blame it, value unknown
            rec.forward_first = (name, f"{name} output", float("inf"))
            return
        finally:
            rec.busy = False
        value, new = _out_of_range(output, wide)
        if new:
            rec.forward_first = (name, f"{name} output", value)

    def backward(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        if not rec.backward_on:
            return
        name = names[id(module)]
        rec.grad_absmax[name] = max(rec.grad_absmax.get(name, 0.0), _absmax(grad_output))
        rec.grad_in_absmax[name] = max(rec.grad_in_absmax.get(name, 0.0), _absmax(grad_input))
        rec.backward_order.append(name)
        if rec.backward_first is None and _finite(grad_output) and not _finite(grad_input):
            rec.backward_first = (name, f"gradient of {name}'s input")

    try:
        for m in model.modules():
            handles.append(m.register_forward_hook(forward, with_kwargs=True))
            if not list(m.children()):
                handles.append(m.register_full_backward_hook(backward))
        with warnings.catch_warnings():  # the first layer's inputs need no gradient: expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        for h in handles:
            h.remove()


def first_backward(model: torch.nn.Module, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
                    rec: Record) -> tuple[str, str] | None:
    """The first module, in backward order, whose input gradient or parameter gradient is non-finite."""
    bad = {id(p) for p, g in zip(params, grads) if not bool(torch.isfinite(g).all())}
    owners = list(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n, p in model.named_parameters()
                                if id(p) in bad))
    order = {n: i for i, n in reversed(list(enumerate(rec.backward_order)))}
    found: list[tuple[int, str, str]] = [(order.get(m, len(order)), m, f"{m} parameter gradient") for m in owners]
    if rec.backward_first is not None:
        found.append((order.get(rec.backward_first[0], len(order)), *rec.backward_first))
    if not found:
        return None
    _, module, tensor = min(found)
    return module, tensor


def backward_value(first: tuple[str, str], model: torch.nn.Module, params: list[torch.nn.Parameter],
                    ref: list[torch.Tensor], ref_rec: Record, scale: float) -> float | None:
    """The magnitude the overflowing tensor needed: its fp32 abs-max times ``scale``."""
    module, tensor = first
    if tensor.endswith("parameter gradient"):
        mine = {id(p) for p in model.get_submodule(module).parameters(recurse=False)} if module else set()
        vals = [float(r.abs().max()) for p, r in zip(params, ref) if id(p) in mine and r.numel()]
        return max(vals) * scale if vals else None
    value = ref_rec.grad_in_absmax.get(module)
    return None if value is None else value * scale


def safe_scale(fmax: float, ref_rec: Record, ref: list[torch.Tensor]) -> float:
    """The largest scale at which no fp32 activation or parameter gradient would leave the range:
    ``fmax / max(|g|)`` (``inf`` for an all-zero gradient)."""
    peak = max([*ref_rec.grad_absmax.values(), *(float(r.abs().max()) for r in ref if r.numel())], default=0.0)
    return fmax / peak if peak > 0 else float("inf")
