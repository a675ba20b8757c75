"""The pieces of one model's layer boundaries (:mod:`strategies.boundaries`): the trace of a
forward pass, the users registered on it, the walks a call's arguments share between its pre-
and post-hook, and the hook that runs the users' transforms of one call's output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["GradFn", "Handle", "Hook", "Trace", "User", "Walk", "any_call", "timed"]


GradFn = Callable[["Trace", int, torch.Tensor], "torch.Tensor | None"]


@dataclass(eq=False)
class Trace:
    """The hooked module calls of one forward pass, in order (host-side bookkeeping only).

    ``data`` holds each user's own bookkeeping of this pass (keyed by the user); ``closed``: the
    next hooked call starts a new trace (the root forward returned, or a backward reached it)."""

    calls: list[torch.nn.Module] = field(default_factory=list)
    data: dict[Any, Any] = field(default_factory=dict)
    closed: bool = False
    open: list[torch.nn.Module] = field(default_factory=list)  # hooked calls in progress (nesting)
    walks: list[list["Walk"]] = field(default_factory=list)  # per open call: its arguments' walks (Walk)


@dataclass(eq=False)
class User:
    stage: str
    modules: set[int]
    on_grad: GradFn | None
    on_call: Callable[[Trace, int], None] | None
    on_end: Callable[[Trace], None] | None
    when: Callable[[], bool] | None
    on_link: Callable[[Trace, int, list[tuple[Trace, int]], list[torch.Tensor]], None] | None = None
    on_inputs: Callable[[torch.nn.Module, torch.Tensor, list[tuple["Trace", int]]], "torch.Tensor | None"] | None = None
    owner: Any = None
    seconds: float = 0.0  # host time spent in this user's callbacks so far

    def stop(self, trace: Trace, i: int) -> bool:
        """Walks for this user end at the outputs of its modules' calls."""
        return id(trace.calls[i]) in self.modules


@dataclass(eq=False)
class Walk:
    """A walk (:func:`reached`) from one tensor argument ``t`` of a call, made before the call for a
    user's ``on_inputs``, and reused for its ``on_link`` after the call while the argument is the
    same tensor at the same version (no in-place op on it inside the call changed the graph below
    it): one walk per argument, not two. ``tid``: ``id(t)`` (the call's arguments keep ``t`` alive;
    the trace keeps no tensor of the graph)."""

    user: User
    tid: int
    version: int
    below: list[tuple[Trace, int]]
    leaves: list[torch.Tensor]


def timed(user: User, fn: Callable[..., Any], *args: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        user.seconds += time.perf_counter() - t0


class Handle:
    def __init__(self, owner: Any, user: User) -> None:
        self._owner, self._user = owner, user

    @property
    def seconds(self) -> float:
        """Host seconds this user's callbacks (forward and backward) have run so far."""
        return self._user.seconds

    def remove(self) -> None:
        self._owner._remove(self._user)


def any_call(trace: Trace, i: int) -> bool:
    return True


class Hook:
    """The users' transforms of one call's output, in stage order: a tensor hook on the returned
    view, or — once an in-place op on that view has routed the gradient around it (found by a
    walk, :meth:`move_to`) — a pre-hook on the node that produced the output."""

    def __init__(self, chain: list[User], trace: Trace, i: int) -> None:
        self.chain, self.trace, self.i, self.moved = chain, trace, i, False

    def __call__(self, g: torch.Tensor) -> torch.Tensor | None:
        if self.moved:
            return None
        return self.run(g)

    def run(self, g: torch.Tensor) -> torch.Tensor | None:
        self.trace.closed = True
        out = None
        for u in self.chain:
            new = timed(u, u.on_grad, self.trace, self.i, g)
            if new is not None:
                g = out = new
        return out

    def move_to(self, node: Any, nr: int) -> None:
        """Transform at the producer's output ``nr`` instead: an in-place op on the returned view
        (``ReLU(inplace=True)``) sends the gradient there through ``CopySlices``, not through the
        view (the in-place op also means the producer did not save its output)."""
        if self.moved:
            return
        self.moved = True

        def pre(grads: tuple[Any, ...]) -> tuple[Any, ...] | None:
            g = grads[nr]
            new = None if g is None else self.run(g)
            return None if new is None else tuple(new if k == nr else x for k, x in enumerate(grads))

        node.register_prehook(pre)
