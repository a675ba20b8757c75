"""A model's layers: the one definition of where its layer boundaries are (the per-layer
strategies' default groups, the fp8 simulation, the observers, the per-layer fidelity and the
doctor's per-layer damage all use it).

:func:`layers` returns qualified module names, in registration order:

1. the model's ``boundaries`` attribute when it declares one (scalelab's own models do);
2. else every child module that owns trainable parameters, where two kinds of child are
   **opened** (replaced by their own children, recursively, by the same rule):

   * containers that are never called themselves (``ModuleList``, ``ModuleDict``,
     ``ParameterList``, ``ParameterDict``): their members are;
   * a module with a **block list** below it that owns no trainable parameter itself. A block
     list is a ``ModuleList`` whose members (one or more) are all of one class and own
     trainable parameters: the repeated blocks of a transformer (GPT-2 ``transformer.h``,
     Llama ``model.layers``, ViT ``vit.layers``, BERT ``bert.encoder.layer``, T5
     ``encoder.block`` and ``decoder.block``).

   A member of a block list is a layer and is never opened (a mixture-of-experts block stays one
   layer), so each block is one layer and the modules before and after the blocks (embeddings,
   final norm, head) are layers of their own: ``transformer.wte``, ``transformer.wpe``,
   ``transformer.h.0``, …, ``transformer.ln_f``, ``lm_head`` for HF GPT-2. A module that owns
   a parameter directly (ViT's embeddings with their ``cls_token``) is never opened, or that
   parameter would belong to no layer. ``nn.Sequential`` is called as one module, so it is not a
   container and not a block list: torchvision ResNet's stages stay one layer each, as do the
   members of a ``ModuleList`` of mixed classes (T5's ``block.N.layer``).
"""

from __future__ import annotations

import torch

__all__ = ["CONTAINERS", "block_list", "layers"]

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
"""Modules that are never called themselves: their members are."""


def _trainable(m: torch.nn.Module, recurse: bool = True) -> bool:
    return any(p.requires_grad for p in m.parameters(recurse=recurse))


def block_list(m: torch.nn.Module) -> bool:
    """Is ``m`` a block list: a ``ModuleList`` whose members are all of one class and own
    trainable parameters (module docstring)?"""
    members = list(m.children()) if isinstance(m, torch.nn.ModuleList) else []
    return bool(members) and len({type(b) for b in members}) == 1 and all(_trainable(b) for b in members)


def _opened(m: torch.nn.Module) -> bool:
    """A child replaced by its children: a container, or a module on the way to a block list
    that owns no trainable parameter itself."""
    if isinstance(m, CONTAINERS):
        return True
    return not _trainable(m, recurse=False) and any(block_list(d) for d in m.modules() if d is not m)


def layers(model: torch.nn.Module) -> list[str]:
    """The model's layer names (see the module docstring)."""
    declared = getattr(model, "boundaries", None)
    if declared:
        return [str(n) for n in declared]
    found: list[str] = []

    def visit(prefix: str, parent: torch.nn.Module, blocks: bool) -> None:
        for n, m in parent.named_children():
            if not _trainable(m):
                continue
            if not blocks and _opened(m):
                visit(f"{prefix}{n}.", m, block_list(m))
            else:
                found.append(f"{prefix}{n}")

    visit("", model, block_list(model))
    return found
