"""Marks and walks of the autograd graph: how the layer boundaries (:mod:`strategies.boundaries`)
know which hooked call consumes which.

The autograd node of each returned view, and the producer's output behind it, are marked with
their call (``node.metadata``). Walking the graph down from some tensors (a call's inputs, a
loss) through unmarked nodes (never past a :func:`fence`) finds the calls whose outputs they
consume through other ops — ``layerwise`` uses this to learn, for each call, which group
consumes its output. A walk that arrives at a producer's output around its view (an in-place op
on the view: autograd's ``CopySlices`` sends the gradient to the producer, past the view's hook)
moves that call's transforms onto a pre-hook of the producer node. Every hooked call walks from
its inputs, and a strategy's ``scale()`` from the loss, so the move happens before any backward.

A :func:`fence` is a view no walk goes past: a user that converts, at a call's input, the
gradient that call sends down (``layerwise``: an output an earlier group already consumes) owns
the links below it. ``reached(..., leaves=[...])`` also returns the leaf tensors (parameters)
the walked ops use, so a user can tell a parameter used outside every module that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from strategies.boundary_calls import Trace

__all__ = ["fence", "flat", "mark", "reached", "tensors_in"]

_MARK = "scalelab.boundary"  # node.metadata key: {output_nr: [(trace, call index, hook, around), ...]}
_FENCE = "scalelab.fence"  # node.metadata key: walks stop here (see fence)


def mark(node: Any, nr: int, trace: "Trace", i: int, hook: Any, around: bool) -> None:
    """Mark output ``nr`` of ``node`` as call ``i`` of ``trace``: the returned view's node
    (``around`` False) or the producer's output behind it (True); ``hook`` (or None) has the
    call's transforms and a ``move_to(node, nr)``."""
    node.metadata.setdefault(_MARK, {}).setdefault(nr, []).append((trace, i, hook, around))


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested lists/tuples/dicts (other iterables are left unread). A tensor, or a
    flat tuple of tensors (a module's positional arguments), is read without pytree: it is the
    common case of every hooked call, and pytree costs tens of microseconds per call."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if flat(tree):
        return list(tree)
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def flat(tree: Any) -> bool:
    """Is ``tree`` a tuple of tensors only?"""
    if type(tree) is not tuple:
        return False
    for t in tree:
        if not isinstance(t, torch.Tensor):
            return False
    return True


def reached(tensors: Iterable[Any], stop: Callable[[Trace, int], bool],
            leaves: list[torch.Tensor] | None = None) -> list[tuple[Trace, int]]:
    """The hooked calls ``(trace, i)`` with ``stop(trace, i)`` whose outputs ``tensors`` depend on
    through other ops: a walk down the autograd graph from the tensors that ends at the marked
    output of such a call and goes on through everything else (host-side; it visits only the
    ops between the tensors and those calls). A walk that reaches a call's output around its
    returned view (an in-place op on the view) moves that call's transforms onto the producer.
    ``leaves``, if given, receives the leaf tensors (parameters) those ops use. (Every hooked
    call walks, so this loop is written for the interpreter: one ``metadata`` read per node.)"""
    found: list[tuple[Trace, int]] = []
    stack: list[tuple[Any, int]] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            node = t.grad_fn
            if node is not None:
                stack.append((node, t.output_nr))
            elif leaves is not None and t.requires_grad:
                leaves.append(t)
    seen: set[tuple[Any, int]] = set()
    expanded: set[Any] = set()
    while stack:
        edge = stack.pop()
        if edge in seen:
            continue
        seen.add(edge)
        node, nr = edge
        meta = node.metadata
        if meta:
            if _FENCE in meta:
                continue
            marks = meta.get(_MARK)
            hit = False
            if marks:
                for trace, i, hook, around in marks.get(nr, ()):
                    if around and hook is not None:
                        hook.move_to(node, nr)
                    if stop(trace, i):
                        hit = True
                        if (trace, i) not in found:
                            found.append((trace, i))
            if hit:
                continue
        if node not in expanded:
            expanded.add(node)
            if leaves is not None and hasattr(node, "variable"):  # AccumulateGrad: a leaf used here
                leaves.append(node.variable)
            for n, k in node.next_functions:
                if n is not None:
                    stack.append((n, k))
    return found


def fence(t: torch.Tensor, hook: Callable[[torch.Tensor], "torch.Tensor | None"]) -> torch.Tensor:
    """``t`` as a view whose gradient goes through ``hook`` (a tensor hook) and past which no walk
    (:func:`reached`) goes: a user's ``on_inputs`` returns it to handle, on its own, the
    gradient one call's input sends down (so the links below it are that user's business)."""
    out = t.view_as(t)
    out.grad_fn.metadata[_FENCE] = True
    out.register_hook(hook)
    return out
