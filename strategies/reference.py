"""fp32 reference passes that are provably fp32.

Rules that compare the mixed-precision gradient with an fp32 one (``norm_ratio``'s probe, the
app's fidelity probe) recompute the loss with autocast switched off. An autocast *inside* the
model's forward — accelerate's ``prepare()`` wraps ``model.forward`` in one — switches it back on,
and the "fp32" reference silently runs in fp16. :func:`fp32_loss` runs the closure under a
dispatch mode that sees every op, and raises one clear error when any op produced a float16,
bfloat16 or float8 tensor. :func:`fp32_forward` is the way out: the module's own forward under
such a wrapper, reached without changing the module (``accelerator.unwrap_model(model,
keep_fp32_wrapper=False)`` strips the wrapper from the model object itself, so the training
forwards would then run in fp32 too).
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LowPrecisionReference", "fp32_forward", "fp32_loss"]

LOW = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


class LowPrecisionReference(RuntimeError):
    """The fp32 reference pass computed in a low-precision format."""


class _Watch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, torch.dtype] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype in LOW:
                    self.first = (str(func), t.dtype)
                    break
        return out


def fp32_loss(closure: Callable[[], torch.Tensor], device_type: str, who: str) -> torch.Tensor:
    """``closure()`` with autocast disabled, checked to have run entirely in fp32 (or wider)."""
    watch = _Watch()
    with torch.autocast(device_type, enabled=False), watch:
        loss = closure()
    if watch.first is not None:
        op, dtype = watch.first
        raise LowPrecisionReference(
            f"{who}: the fp32 reference forward computed {op} in {dtype}: an autocast inside the model's "
            "forward (e.g. accelerate's prepare() wraps forward in autocast) overrides the reference's "
            "autocast(enabled=False); call the model through strategies.reference.fp32_forward(model) "
            "in the reference (its forward under the wrapper; the model itself is left as it is)")
    return loss


def fp32_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """``module``'s forward beneath the wrappers put on its ``forward`` attribute (accelerate's
    ``prepare()``: ``model.forward = MethodType(convert_outputs_to_fp32(autocast(forward.__func__)),
    model)``, each layer a ``functools.wraps`` with ``__wrapped__``), bound to ``module``, without
    assigning anything: the training forwards keep their autocast. Hooks of ``module`` are not
    run (call it as ``module.forward`` would be called)."""
    forward = module.forward
    if not isinstance(forward, MethodType):
        return forward  # a plain callable set on the instance: no method beneath it to reach
    func = forward.__func__
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return MethodType(func, module)
