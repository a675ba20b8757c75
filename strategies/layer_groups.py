"""Layer groups of a per-layer strategy: which modules form a group, and the checks that keep
per-group scales exact.

* :func:`resolve` — the default groups are the model's layers (:func:`strategies.boundaries.layers`),
  else one group per fnmatch pattern over module names (outermost match, first pattern wins);
* tied weights: a parameter owned by modules of two groups (nanoGPT and GPT-2 tie the token
  embedding to the LM head) would collect gradient contributions at two scales and be unscaled
  by one. :func:`resolve` merges such groups into one (named ``"a+b"``, with one warning). A
  merged group may be called at several places of the chain; the per-call rescaling handles
  that, so merging is exact;
* skip connections: :func:`check_chain` walks the autograd graph of one forward pass and refuses
  (one ``ValueError``) an activation of call m consumed by a later call n whose group differs
  from that of call m + 1 — its gradient would sum contributions at two scales.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

import torch

from strategies.boundaries import Trace, layers

__all__ = ["check_chain", "resolve"]

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


def _merge_tied(model: torch.nn.Module, groups: Groups) -> Groups:
    """Merge groups whose modules share a parameter (union-find over group indices)."""
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
        return groups
    merged: dict[int, tuple[list[str], list[torch.nn.Module]]] = {}
    for gi, (name, mods) in enumerate(groups):
        entry = merged.setdefault(find(gi), ([], []))
        entry[0].append(name)
        entry[1].extend(m for m in mods if all(m is not x for x in entry[1]))
    out = [("+".join(n), mods) for n, mods in merged.values()]
    joined = [n for n, _ in out if "+" in n]
    warnings.warn(f"layerwise: parameters {sorted(set(shared))} are shared between groups (tied weights); "
                  f"merged into one group each: {joined}", stacklevel=4)
    return out


def resolve(model: torch.nn.Module, patterns: list[str] | None) -> Groups:
    """The groups of ``model``: its layers, or one per pattern; groups sharing parameters merged."""
    if patterns is None:
        groups: Groups = [(name, [model.get_submodule(name)]) for name in layers(model)]
    else:
        groups = _by_patterns(model, patterns)
    return _merge_tied(model, groups)


def check_chain(trace: Trace, group_of: dict[int, int], names: list[str]) -> None:
    """Refuse a forward pass whose group calls do not form a chain (see the module docstring).

    ``group_of`` maps ``id(module)`` to its group; calls of other modules are ignored."""
    mine = [(i, group_of[id(m)]) for i, m in enumerate(trace.calls) if id(m) in group_of]
    position: dict[Any, int] = {}
    for pos, (i, _) in enumerate(mine):
        for node in trace.nodes[i] if i < len(trace.nodes) else []:
            position[node] = pos
    for pos, (i, g) in enumerate(mine):
        stack = [nxt for node in trace.nodes[i] for nxt, _ in node.next_functions if nxt is not None]
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            m = position.get(node)
            if m is None:
                stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
                continue
            if m < pos - 1 and mine[m + 1][1] != g:
                raise ValueError(
                    f"layerwise: the output of group {names[mine[m][1]]!r} is also consumed by group "
                    f"{names[g]!r}, past group {names[mine[m + 1][1]]!r} (a skip connection across a group "
                    "boundary): its gradient would mix two scales. Pass groups=[...] patterns that put the "
                    f"layers from {names[mine[m + 1][1]]!r} to {names[g]!r} in one group")
