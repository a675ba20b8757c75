"""A model's layers: the one definition of where its layer boundaries are (the per-layer
strategies' default groups, the fp8 simulation, the observers, the per-layer fidelity and the
doctor's per-layer damage all use it).

:func:`layers` returns qualified module names, in registration order: the model's
``boundaries`` attribute when it declares one (scalelab's own models do), else every top-level
child module that owns trainable parameters, looking inside containers that are never called
themselves (``ModuleList``, ``ModuleDict``) — so ``embed``, ``blocks.0``, ``blocks.1``,
``ln_f``, ``head`` for a nanoGPT-style model.
"""

from __future__ import annotations

import torch

__all__ = ["CONTAINERS", "layers"]

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
"""Modules that are never called themselves: their members are."""


def layers(model: torch.nn.Module) -> list[str]:
    """The model's layer names (see the module docstring)."""
    declared = getattr(model, "boundaries", None)
    if declared:
        return [str(n) for n in declared]
    found: list[str] = []

    def visit(prefix: str, parent: torch.nn.Module) -> None:
        for n, m in parent.named_children():
            if not any(p.requires_grad for p in m.parameters()):
                continue
            if isinstance(m, CONTAINERS):  # never called itself: its members are
                visit(f"{prefix}{n}.", m)
            else:
                found.append(f"{prefix}{n}")

    visit("", model)
    return found
