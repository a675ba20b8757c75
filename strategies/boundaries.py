"""Layer boundaries: the one place where anything hooks the activation gradients between layers.

A model's **layers** are :func:`strategies.model_layers.layers` (its declared ``boundaries``,
else its children that own parameters, opened down to its repeated blocks) — so ``embed``,
``blocks.0``, ``blocks.1``, ``ln_f``, ``head`` for a nanoGPT-style model.

Three kinds of user transform the gradient that leaves a layer's output on its way down in
backward, and :class:`Boundaries` applies them in this fixed, documented order:

1. ``"rescale"`` — per-layer strategies (``layerwise``): convert the gradient from the scale of
   the consumer's group to the producer's (an exact power-of-two ratio);
2. ``"quantize"`` — precision simulation (fp8): per-tensor cast scaling and quantise–dequantise,
   so the value is quantised at the scale the receiving layer computes with;
3. ``"observe"`` — telemetry: read-only measurements of what the layer below receives.

Each hooked module gets one forward hook (and one pre-hook, below), however many users. A
host-side :class:`Trace` records the hooked calls of one forward pass in order. Each tensor
output ``t`` of a call is returned as ``t.view_as(t)`` — an ordinary view, so the consumers' ops
(the other side of the boundary) and the module's own ops (which may have saved ``t``) see two
tensors — with one tensor hook (``Tensor.register_hook``) that runs the users' transforms of
that call in stage order, so the result never depends on which user attached first (tested). An
ordinary view with a hook, not an identity autograd Function: a later in-place op on the output
(torchvision's ``ReLU(inplace=True)`` after a hooked ``BatchNorm``) is allowed (a custom
Function's view output refuses it), and the hook still receives the gradient of the value the
module returned.

**Traces.** The model's own forward starts a trace and closes it when it returns. Hooked modules
called outside it (models in a never-called ``ModuleList``, called one by one) share a trace
until a backward reaches one of its calls: the next hooked call starts a fresh one. A trace holds
the called modules and its users' bookkeeping, never autograd nodes, so nothing of a step's graph
outlives the step through it; the graph refers to its trace (the hooks and the node marks below),
not the other way round.

**Links** (:mod:`strategies.graph_walk`). The autograd node of each returned view, and the
producer's output behind it, are marked with their call; :func:`strategies.graph_walk.reached`
walks down from some tensors (a call's inputs, a loss) to the calls whose outputs they consume.

**Scaled backwards** (:class:`strategies.scaled_backwards.ScaledBackwards`): a strategy's
transforms act only on a backward whose loss went through *its* ``scale()``.

**Inputs and nesting.** Each hooked module also gets one forward pre-hook: a user's
``on_inputs`` may pass a :func:`strategies.graph_walk.fence` in place of a tensor argument (``layerwise`` converts
there the gradient a call sends into an output that an earlier group already consumes), and a
call made while another call of the same user's modules is in progress (an aliased module inside
a group, a recursion) is nested: that user sees only the outer call.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_map

from strategies.graph_walk import flat, mark, reached, tensors_in

__all__ = ["STAGES", "Boundaries", "Trace"]

STAGES = ("rescale", "quantize", "observe")


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


@dataclass(eq=False)
class _User:
    stage: str
    modules: set[int]
    on_grad: GradFn | None
    on_call: Callable[[Trace, int], None] | None
    on_end: Callable[[Trace], None] | None
    when: Callable[[], bool] | None
    on_link: Callable[[Trace, int, list[tuple[Trace, int]], list[torch.Tensor]], None] | None = None
    on_inputs: Callable[[torch.nn.Module, torch.Tensor], "torch.Tensor | None"] | None = None
    owner: Any = None
    seconds: float = 0.0  # host time spent in this user's callbacks so far


def _timed(user: _User, fn: Callable[..., Any], *args: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        user.seconds += time.perf_counter() - t0


class Handle:
    def __init__(self, owner: "Boundaries", user: _User) -> None:
        self._owner, self._user = owner, user

    @property
    def seconds(self) -> float:
        """Host seconds this user's callbacks (forward and backward) have run so far."""
        return self._user.seconds

    def remove(self) -> None:
        self._owner._remove(self._user)


def _any(trace: Trace, i: int) -> bool:
    return True


class _Hook:
    """The users' transforms of one call's output, in stage order: a tensor hook on the returned
    view, or — once an in-place op on that view has routed the gradient around it (found by a
    walk, :meth:`move_to`) — a pre-hook on the node that produced the output."""

    def __init__(self, chain: list[_User], trace: Trace, i: int) -> None:
        self.chain, self.trace, self.i, self.moved = chain, trace, i, False

    def __call__(self, g: torch.Tensor) -> torch.Tensor | None:
        if self.moved:
            return None
        return self.run(g)

    def run(self, g: torch.Tensor) -> torch.Tensor | None:
        self.trace.closed = True
        out = None
        for u in self.chain:
            new = _timed(u, u.on_grad, self.trace, self.i, g)
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


class Boundaries:
    """The hooks of one model, shared by every user (:meth:`of` returns the model's instance)."""

    _instances: "weakref.WeakKeyDictionary[torch.nn.Module, Boundaries]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Boundaries":
        return cls._instances.get(model) or cls._instances.setdefault(model, cls(model))

    def __init__(self, model: torch.nn.Module) -> None:
        self._model_ref = weakref.ref(model)
        self._users: list[_User] = []
        self._hooks: dict[int, Any] = {}
        self._root_hooks: list[Any] = []
        self._disabled = 0
        self.trace: Trace | None = None

    @property
    def off(self) -> bool:
        """True inside :meth:`disabled`: transforms outside the boundary hooks (the fp8 forward
        casts of ``experiments/workloads/fp8_forward.py``) keep out of the same passes."""
        return self._disabled > 0

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """No user sees the forward passes run inside (e.g. an fp32 reference gradient)."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    def register(
        self,
        stage: str,
        modules: Iterable[torch.nn.Module],
        on_grad: GradFn | None = None,
        on_call: Callable[[Trace, int], None] | None = None,
        on_end: Callable[[Trace], None] | None = None,
        when: Callable[[], bool] | None = None,
        on_link: Callable[[Trace, int, list[tuple[Trace, int]], list[torch.Tensor]], None] | None = None,
        on_inputs: Callable[[torch.nn.Module, torch.Tensor], "torch.Tensor | None"] | None = None,
        owner: Any = None,
    ) -> Handle:
        """Call ``on_call(trace, i)`` at each call of one of ``modules`` (forward, grad enabled),
        ``on_end(trace)`` when the model's forward returns, and ``on_grad(trace, i, g)`` in backward
        with the gradient of call ``i``'s output (return a replacement or ``None``). ``when()``, if
        given, is asked at each call in forward: False leaves this call's gradient untouched by
        ``on_grad`` (decided in forward, so a backward run later agrees). ``on_link(trace, i, below,
        leaves)``: at each call, this user's earlier calls whose outputs the call's tensor arguments
        consume, and the leaves the ops between use (:func:`reached`). ``on_inputs(module, t)``:
        before each call, each tensor argument that requires grad; a returned tensor (a
        :func:`strategies.graph_walk.fence`) is passed instead. A call made inside another call of
        the same user's modules (an aliased module, a recursion) is nested: that user sees only the
        outer one. ``owner`` (a strategy): refused with one ``ValueError`` while another owner has
        hooks on this model or on one of its modules."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        modules = list(modules)
        if owner is not None:
            self._refuse_second_owner(owner)
        user = _User(stage, {id(m) for m in modules}, on_grad, on_call, on_end, when, on_link, on_inputs, owner)
        self._users.append(user)
        self._users.sort(key=lambda u: STAGES.index(u.stage))  # stable: same stage keeps its order
        for m in modules:
            if id(m) not in self._hooks:
                self._hooks[id(m)] = (m.register_forward_pre_hook(self._on_input, with_kwargs=True),
                                      m.register_forward_hook(self._on_output, with_kwargs=True))
        model = self._model_ref()
        if model is not None and not self._root_hooks:
            self._root_hooks = [model.register_forward_pre_hook(self._start),
                                model.register_forward_hook(self._end)]
        return Handle(self, user)

    def _refuse_second_owner(self, owner: Any) -> None:
        model = self._model_ref()
        mine = {id(m) for m in model.modules()} if model is not None else set()
        for other_model, inst in list(Boundaries._instances.items()):
            for u in inst._users:
                if u.owner is not None and u.owner is not owner and u.modules & mine:
                    name = getattr(u.owner, "name", type(u.owner).__name__)
                    raise ValueError(
                        f"{type(model).__name__} already carries the boundary hooks of strategy {name!r} (attached to "
                        f"{type(other_model).__name__}); call that strategy's detach() before attaching another")

    def _remove(self, user: _User) -> None:
        if user not in self._users:
            return
        self._users.remove(user)
        still = set().union(*(u.modules for u in self._users)) if self._users else set()
        for mid in list(self._hooks):
            if mid not in still:
                for h in self._hooks.pop(mid):
                    h.remove()
        if not self._users:
            for h in self._root_hooks:
                h.remove()
            self._root_hooks = []
            self.trace = None

    def settle(self, tensors: Any) -> None:
        """Before a backward of ``tensors`` (a strategy's ``scale()``): move the transforms of the
        calls whose returned view the ops up to ``tensors`` modified in place (:func:`reached`)."""
        reached(tensors_in(tensors), _any)

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self.trace = None if self._disabled else Trace()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        trace = self.trace
        if trace is not None:
            trace.closed = True
            reached(tensors_in(output), _any)  # in-place ops on the last calls' views, inside the forward
            for u in list(self._users):
                if u.on_end is not None:
                    _timed(u, u.on_end, trace)

    def _current(self) -> Trace:
        if self.trace is None or self.trace.closed:  # called outside the model's own forward
            self.trace = Trace()
        return self.trace

    @staticmethod
    def _outer(users: list[_User], module: torch.nn.Module, trace: Trace) -> list[_User]:
        """The users of ``module`` for whom this call is not nested in a call of their modules."""
        return [u for u in users if id(module) in u.modules and not any(id(m) in u.modules for m in trace.open)]

    def _on_input(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if self._disabled or not torch.is_grad_enabled():
            return None
        trace = self._current()
        users = [u for u in self._outer(self._users, module, trace) if u.on_inputs is not None]
        trace.open.append(module)
        changed = False

        def swap(t: Any) -> Any:
            nonlocal changed
            if isinstance(t, torch.Tensor) and t.requires_grad:
                for u in users:
                    new = _timed(u, u.on_inputs, module, t)
                    if new is not None:
                        t, changed = new, True
            return t

        if not users:
            new_args, new_kwargs = args, kwargs
        elif not kwargs and flat(args):  # the common call: positional tensors, no pytree
            new_args, new_kwargs = tuple(swap(t) for t in args), kwargs
        else:
            new_args, new_kwargs = tree_map(swap, (args, kwargs))
        return (new_args, new_kwargs) if changed else None

    def _on_output(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if self._disabled or not torch.is_grad_enabled():
            return None
        trace = self._current()
        if module in trace.open:  # the innermost call of this module is the one returning
            del trace.open[len(trace.open) - 1 - trace.open[::-1].index(module)]
        i = len(trace.calls)
        trace.calls.append(module)
        inputs = tensors_in(args if not kwargs else (args, kwargs))
        users = self._outer(self._users, module, trace)
        if not any(u.on_link is not None for u in users):  # else a link walk below passes every call this one stops at
            reached(inputs, _any)  # moves the transforms of earlier calls whose view was modified in place
        for u in users:
            if u.on_call is not None:
                _timed(u, u.on_call, trace, i)
            if u.on_link is not None:
                leaves: list[torch.Tensor] = []
                mine = u.modules
                below = _timed(u, reached, inputs, lambda tr, k: id(tr.calls[k]) in mine, leaves)
                _timed(u, u.on_link, trace, i, below, leaves)
        chain = [u for u in users if u.on_grad is not None and (u.when is None or u.when())]
        hook = _Hook(chain, trace, i) if chain else None

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                return t
            out = t.view_as(t)  # consumers' side of the boundary; the module's own ops keep t
            for node, nr, around in ((out.grad_fn, 0, False), (t.grad_fn, t.output_nr, True)):
                if node is not None:
                    mark(node, nr, trace, i, hook, around)
            if hook is not None:
                out.register_hook(hook)
            return out

        return wrap(output) if isinstance(output, torch.Tensor) else tree_map(wrap, output)
