"""Keep chosen modules in fp32 under autocast: the "keep this module in fp32" remedy.

Users whose fp16 training breaks are told to run the fragile module in full precision while the
rest stays in fp16: HF transformers' ``_keep_in_fp32_modules`` (T5's ``wo``, issue #9295, "T5 fp16
NaN") and, for RL, the LM head: MiniMax-M1 (arXiv 2506.13585) traced the training/inference
probability mismatch to the LM head and computed it in fp32; ScaleRL (arXiv 2510.13786) adopted
it, and TRL's GRPO trainer ships it as an option (huggingface/trl PR #4303, "Support casting LM
Head to FP32"; also sgl-project/sglang issue #10490, vllm-project/vllm issue #19925).

:func:`keep_in_fp32` wraps the ``forward`` of each named module: inside it autocast is off and
every floating-point tensor argument is cast to fp32, so the module's matmuls, its output and (in
backward) the gradient of its input and weights are fp32; the modules before and after it still
run under the precision's autocast. With no autocast active (an fp32 run) nothing changes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

__all__ = ["keep_in_fp32"]


def _fp32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's class ``forward`` with autocast off and floating-point arguments in fp32.
    Bound to the instance (``types.MethodType``), so a ``copy.deepcopy`` of the model (a frozen
    reference policy) rebinds it to the copy."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device_type = first.device.type if first is not None else "cpu"
    with torch.autocast(device_type, enabled=False):
        return type(self).forward(self, *(_fp32(a) for a in args), **{k: _fp32(a) for k, a in kwargs.items()})


def keep_in_fp32(model: nn.Module, names: list[str] | tuple[str, ...]) -> list[str]:
    """Run the sub-modules ``names`` (dotted, as ``model.named_modules()`` spells them) in fp32
    under autocast (module docstring); returns the names wrapped. Raises ``ValueError`` naming a
    module the model does not have."""
    modules = dict(model.named_modules())
    for name in names:
        if not name or name not in modules:
            known = ", ".join(n for n in modules if n and "." not in n)
            raise ValueError(f"model.keep_fp32 names a module the model does not have: {name!r} (top-level "
                             f"modules: {known})")
        module = modules[name]
        module.forward = types.MethodType(_fp32_forward, module)  # type: ignore[method-assign]  # this instance only
    return list(names)
