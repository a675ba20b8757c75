"""Layer groups of a per-layer strategy: which modules form a group, and the checks that keep
per-group scales exact.

* :func:`resolve` — the default groups are the model's layers (:func:`strategies.boundaries.layers`),
  else one group per fnmatch pattern over module names (outermost match, first pattern wins);
* tied weights: a parameter owned by modules of two groups (nanoGPT and GPT-2 tie the token
  embedding to the LM head) would collect gradient contributions at two scales and be unscaled
  by one. :func:`resolve` merges such groups into one (named ``"a+b"``, with one warning). A
  merged group may be called at several places of the chain; the per-call rescaling handles
  that, so merging is exact;
* skip connections: at each group call, the graph between its tensor arguments and the earlier
  group calls is walked (:func:`strategies.boundaries.reached`); :func:`link` records which group
  consumes each call's output and refuses (one ``ValueError``) an output consumed by two groups,
  or by a group and a loss scaled at another group's scale — its gradient would sum
  contributions at two scales. A skip connection *inside* a group (residual blocks) is exact;
* overflow attribution: :func:`overflow_origin`, the groups a skipped step is blamed on (the
  per-group rules of ``layerwise`` and AdaLoss back off only those).
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field

import torch

from strategies.boundaries import layers

__all__ = ["Links", "link", "overflow_origin", "resolve"]

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


@dataclass
class Links:
    """What one forward pass (a :class:`strategies.boundaries.Trace`) told a per-group strategy:
    for each call, the group whose scale the gradient of its output arrives at (the group of the
    calls that consume it, or the loss's group for an output the loss consumes directly)."""

    consumer: dict[int, int] = field(default_factory=dict)
    loss_group: int | None = None
    double: bool = False  # a create_graph backward ran through it (gradient penalty)


def link(links: Links, k: int, group: int, producer: str, by: str, names: list[str]) -> None:
    """Record that call ``k`` (of group ``producer``) is consumed by ``group`` (``by`` names the
    consumer); refuse a second consumer of another group with one ``ValueError``."""
    old = links.consumer.setdefault(k, group)
    if old != group:
        raise ValueError(
            f"layerwise: the output of group {producer!r} is also consumed by {by}, past group {names[old]!r} "
            "(a skip connection across a group boundary): its gradient would mix two scales. Pass groups=[...] "
            f"patterns that put the layers from {names[old]!r} to {names[group]!r} in one group")


def overflow_origin(found_inf: torch.Tensor, group_found_inf: torch.Tensor, emitted: torch.Tensor,
                    contaminated: torch.Tensor) -> torch.Tensor:
    """The groups an overflow is attributed to on a skipped step (bool [G]): own gradients or an
    emitted gradient non-finite, and not contaminated from above; every group if none qualifies."""
    skip = found_inf != 0
    blamed = ((group_found_inf != 0) | (emitted > 0)) & ~(contaminated > 0) & skip
    return blamed | (skip & ~blamed.any())
