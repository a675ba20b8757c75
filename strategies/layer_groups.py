"""Layer groups of a per-layer strategy: which modules form a group, and the checks that keep
per-group scales exact.

* :func:`resolve` — the default groups are the model's layers (:func:`strategies.model_layers.layers`),
  else one group per fnmatch pattern over module names (outermost match, first pattern wins);
* tied weights: a parameter collects a gradient contribution at every call of a module that
  owns it, each at the scale the gradient has there, and is unscaled by its group's one scale.
  So :func:`resolve` makes every owner part of the parameter's group: an owner outside every
  group module (T5 in transformers 5: ``encoder.embed_tokens`` is an ``nn.Embedding`` of its own
  sharing ``shared.weight``) joins it, and groups whose modules share a parameter (nanoGPT and
  GPT-2 tie the token embedding to the LM head) merge into one (named ``"a+b"``); one warning
  says both. A group may be called at several places of the chain; the per-call rescaling
  handles that, and an owner called inside a module of its own group (an alias of a module
  inside a group) is nested there (:mod:`strategies.boundaries`), so every case is exact;
* :func:`assign` — the groups and each trainable parameter's group (every one must have one);
* skip connections, and the links between groups that keep per-group scales exact, are
  :mod:`strategies.group_links`'s;
* overflow attribution: :func:`overflow_origin`, the groups a skipped step is blamed on (the
  per-group rules of ``layerwise`` and AdaLoss back off only those).
"""

from __future__ import annotations

import fnmatch
import warnings

import torch

from strategies.model_layers import layers

__all__ = ["Groups", "assign", "overflow_origin", "resolve"]

Groups = list[tuple[str, list[torch.nn.Module]]]


def _by_patterns(model: torch.nn.Module, patterns: list[str]) -> Groups:
    out: Groups = [(p, []) for p in patterns]
    taken: list[str] = []
    for name, mod in model.named_modules():
        if name == "" or any(name.startswith(t + ".") for t in taken):
            continue
        for k, pat in enumerate(patterns):
            if fnmatch.fnmatchcase(name, pat):
                out[k][1].append(mod)
                taken.append(name)
                break
    for pat, mods in out:
        if not mods:
            raise ValueError(f"groups pattern {pat!r} matches no module of {type(model).__name__}")
    return out


def _join_owners(model: torch.nn.Module, groups: Groups) -> list[str]:
    """Add to each grouped parameter's group the modules that own it directly and are reached at
    a path outside every group module (in place); returns ``"module owns parameter"`` lines."""
    group_of: dict[int, int] = {}
    for gi, (_, mods) in enumerate(groups):
        for m in mods:
            for p in m.parameters():
                group_of.setdefault(id(p), gi)
    members = {id(m) for _, mods in groups for m in mods}
    at = dict(model.named_modules(remove_duplicate=False))
    names = {id(p): n for n, p in model.named_parameters()}
    joined: list[str] = []
    for path, mod in at.items():
        own = [p for p in mod.parameters(recurse=False) if id(p) in group_of]
        parts = path.split(".") if path else []
        inside = any(id(at[".".join(parts[:k])]) in members for k in range(len(parts) + 1))
        if own and not inside and id(mod) not in members:
            members.add(id(mod))
            groups[group_of[id(own[0])]][1].append(mod)
            joined.append(f"{path or type(model).__name__} owns {names[id(own[0])]}")
    return joined


def _merge_tied(model: torch.nn.Module, groups: Groups) -> tuple[Groups, list[str]]:
    """Merge groups whose modules share a parameter (union-find over group indices); the groups
    and the shared parameters (``"a.weight = b.weight"``)."""
    root = list(range(len(groups)))

    def find(g: int) -> int:
        while root[g] != g:
            g = root[g]
        return g

    owner: dict[int, int] = {}
    shared: list[str] = []
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for gi, (_, mods) in enumerate(groups):
        for m in mods:
            for p in m.parameters():
                first = owner.setdefault(id(p), gi)
                if find(first) != find(gi):
                    root[find(gi)] = find(first)
                    shared.append(" = ".join(names.get(id(p), ["?"])))
    if not shared:
        return groups, []
    merged: dict[int, tuple[list[str], list[torch.nn.Module]]] = {}
    for gi, (name, mods) in enumerate(groups):
        entry = merged.setdefault(find(gi), ([], []))
        entry[0].append(name)
        entry[1].extend(m for m in mods if all(m is not x for x in entry[1]))
    return [("+".join(n), mods) for n, mods in merged.values()], sorted(set(shared))


def resolve(model: torch.nn.Module, patterns: list[str] | None) -> Groups:
    """The groups of ``model``: its layers, or one per pattern; every module owning a grouped
    parameter in its group, groups sharing parameters merged (module docstring; one warning)."""
    if patterns is None:
        groups: Groups = [(name, [model.get_submodule(name)]) for name in layers(model)]
    else:
        groups = _by_patterns(model, patterns)
    joined = _join_owners(model, groups)
    groups, shared = _merge_tied(model, groups)
    said = []
    if shared:
        said.append(f"parameters {shared} are shared between groups (tied weights); merged into one group "
                    f"each: {[n for n, _ in groups if '+' in n]}")
    if joined:
        said.append(f"modules outside every group own grouped parameters ({'; '.join(joined)}): "
                    "each joined that parameter's group, so its gradient keeps one scale")
    if said:
        warnings.warn("layerwise: " + "; ".join(said), stacklevel=4)
    return groups


def assign(model: torch.nn.Module, patterns: list[str] | None) -> tuple[Groups, dict[int, int]]:
    """The groups of ``model`` (:func:`resolve`; a leaf model is one group of its own, with no
    module to hook) and each trainable parameter's group by ``id`` (its first group). Raises
    ``ValueError`` naming the trainable parameters that belong to no group."""
    groups = resolve(model, patterns)
    if not groups:
        groups = [(type(model).__name__, [])]
        param_group = {id(p): 0 for p in model.parameters()}
    else:
        param_group = {}
        for gi, (_, mods) in enumerate(groups):
            for m in mods:
                for p in m.parameters():
                    param_group.setdefault(id(p), gi)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in param_group]
    if missing:
        raise ValueError(f"layerwise: parameters {missing} belong to no group; "
                         "pass groups=[...] patterns that cover every trainable parameter")
    return groups, param_group


def overflow_origin(found_inf: torch.Tensor, group_found_inf: torch.Tensor, emitted: torch.Tensor,
                    contaminated: torch.Tensor) -> torch.Tensor:
    """The groups an overflow is attributed to on a skipped step (bool [G]): own gradients or an
    emitted gradient non-finite, and not contaminated from above; every group if none qualifies."""
    skip = found_inf != 0
    blamed = ((group_found_inf != 0) | (emitted > 0)) & ~(contaminated > 0) & skip
    return blamed | (skip & ~blamed.any())
