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
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_map

from strategies.boundary_calls import GradFn, Handle, Hook, Trace, User, Walk, any_call, timed
from strategies.graph_walk import flat, mark, reached, tensors_in

__all__ = ["STAGES", "Boundaries", "Trace"]

STAGES = ("rescale", "quantize", "observe")


class Boundaries:
    """The hooks of one model, shared by every user (:meth:`of` returns the model's instance)."""

    _instances: "weakref.WeakKeyDictionary[torch.nn.Module, Boundaries]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Boundaries":
        return cls._instances.get(model) or cls._instances.setdefault(model, cls(model))

    def __init__(self, model: torch.nn.Module) -> None:
        self._model_ref = weakref.ref(model)
        self._users: list[User] = []
        self._by_module: dict[int, list[User]] = {}  # the users of each hooked module, in stage order
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
        on_inputs: Callable[[torch.nn.Module, torch.Tensor, list[tuple[Trace, int]]], "torch.Tensor | None"] | None = None,
        owner: Any = None,
    ) -> Handle:
        """Call ``on_call(trace, i)`` at each call of one of ``modules`` (forward, grad enabled),
        ``on_end(trace)`` when the model's forward returns, and ``on_grad(trace, i, g)`` in backward
        with the gradient of call ``i``'s output (return a replacement or ``None``). ``when()``, if
        given, is asked at each call in forward: False leaves this call's gradient untouched by
        ``on_grad`` (decided in forward, so a backward run later agrees). ``on_link(trace, i, below,
        leaves)``: at each call, this user's earlier calls whose outputs the call's tensor arguments
        consume, and the leaves the ops between use (:func:`reached`). ``on_inputs(module, t, below)``:
        before each call, each tensor argument that requires grad, with this user's earlier calls
        whose outputs it consumes; a returned tensor (a :func:`strategies.graph_walk.fence`) is
        passed instead. A call made inside another call of
        the same user's modules (an aliased module, a recursion) is nested: that user sees only the
        outer one. ``owner`` (a strategy): refused with one ``ValueError`` while another owner has
        hooks on this model or on one of its modules."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        modules = list(modules)
        if owner is not None:
            self._refuse_second_owner(owner)
        user = User(stage, {id(m) for m in modules}, on_grad, on_call, on_end, when, on_link, on_inputs, owner)
        self._users.append(user)
        self._users.sort(key=lambda u: STAGES.index(u.stage))  # stable: same stage keeps its order
        self._index_users()
        for m in modules:
            if id(m) not in self._hooks:
                self._hooks[id(m)] = (m.register_forward_pre_hook(self._on_input, with_kwargs=True),
                                      m.register_forward_hook(self._on_output, with_kwargs=True))
        model = self._model_ref()
        if model is not None and not self._root_hooks:
            self._root_hooks = [model.register_forward_pre_hook(self._start),
                                model.register_forward_hook(self._end)]
        return Handle(self, user)

    def _index_users(self) -> None:
        self._by_module = {}
        for u in self._users:
            for mid in u.modules:
                self._by_module.setdefault(mid, []).append(u)

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

    def _remove(self, user: User) -> None:
        if user not in self._users:
            return
        self._users.remove(user)
        self._index_users()
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
        reached(tensors_in(tensors), any_call)

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self.trace = None if self._disabled else Trace()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        trace = self.trace
        if trace is not None:
            trace.closed = True
            reached(tensors_in(output), any_call)  # in-place ops on the last calls' views, inside the forward
            for u in list(self._users):
                if u.on_end is not None:
                    timed(u, u.on_end, trace)

    def _current(self) -> Trace:
        if self.trace is None or self.trace.closed:  # called outside the model's own forward
            self.trace = Trace()
        return self.trace

    def _outer(self, module: torch.nn.Module, trace: Trace) -> list[User]:
        """The users of ``module`` for whom this call is not nested in a call of their modules."""
        users = self._by_module.get(id(module), [])
        if not trace.open:
            return users
        return [u for u in users if not any(id(m) in u.modules for m in trace.open)]

    def _on_input(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if self._disabled or not torch.is_grad_enabled():
            return None
        trace = self._current()
        users = [u for u in self._outer(module, trace) if u.on_inputs is not None]
        trace.open.append(module)
        walks: list[Walk] = []
        trace.walks.append(walks)
        if not users:
            return None
        changed = False

        def swap(t: Any) -> Any:
            nonlocal changed
            new = self._swap(users, module, t, walks)
            changed |= new is not t
            return new

        if not kwargs and flat(args):  # the common call: positional tensors, no pytree
            new_args, new_kwargs = tuple([swap(t) for t in args]), kwargs
        else:
            new_args, new_kwargs = tree_map(swap, (args, kwargs))
        return (new_args, new_kwargs) if changed else None

    def _swap(self, users: list[User], module: torch.nn.Module, t: Any, walks: list["Walk"]) -> Any:
        """Argument ``t`` as the users' ``on_inputs`` pass it on (a fence in place of it, or ``t``)."""
        if isinstance(t, torch.Tensor) and t.requires_grad:
            for u in users:
                new = timed(u, self._inputs, u, module, t, walks)
                if new is not None:
                    t = new
        return t

    @staticmethod
    def _inputs(u: User, module: torch.nn.Module, t: torch.Tensor, walks: list[Walk]) -> torch.Tensor | None:
        """``u.on_inputs(module, t, below)`` with ``below`` the walk from ``t`` to ``u``'s calls; the
        walk is kept (``walks``) for ``u``'s links after the call unless ``t`` is replaced."""
        leaves: list[torch.Tensor] = []
        below = reached((t,), u.stop, leaves)
        new = u.on_inputs(module, t, below)
        if new is None:
            walks.append(Walk(u, id(t), t._version, below, leaves))
        return new

    @staticmethod
    def _below(u: User, inputs: list[torch.Tensor], walks: list[Walk], leaves: list[torch.Tensor]) -> list[tuple[Trace, int]]:
        """The walk from a call's ``inputs`` to ``u``'s calls (:func:`reached`): the one made before
        the call (:meth:`_inputs`) for a single argument still the same tensor at the same version,
        else a new one."""
        if len(inputs) == 1:
            x = inputs[0]
            for w in walks:
                if w.user is u and w.tid == id(x) and w.version == x._version:
                    leaves.extend(w.leaves)
                    return list(w.below)
        return reached(inputs, u.stop, leaves)

    def _link(self, u: User, trace: Trace, i: int, inputs: list[torch.Tensor], walks: list[Walk]) -> None:
        leaves: list[torch.Tensor] = []
        below = self._below(u, inputs, walks, leaves)
        u.on_link(trace, i, below, leaves)

    def _on_output(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if self._disabled or not torch.is_grad_enabled():
            return None
        trace = self._current()
        walks: list[Walk] = []
        if trace.open and trace.open[-1] is module:  # the common call: not nested, nothing else open
            trace.open.pop()
            walks = trace.walks.pop()
        elif module in trace.open:  # the innermost call of this module is the one returning
            j = len(trace.open) - 1 - trace.open[::-1].index(module)
            del trace.open[j]
            walks = trace.walks.pop(j)
        i = len(trace.calls)
        trace.calls.append(module)
        inputs = tensors_in(args if not kwargs else (args, kwargs))
        users = self._outer(module, trace)
        if not any(u.on_link is not None for u in users):  # else a link walk below passes every call this one stops at
            reached(inputs, any_call)  # moves the transforms of earlier calls whose view was modified in place
        for u in users:
            if u.on_call is not None:
                timed(u, u.on_call, trace, i)
            if u.on_link is not None:
                timed(u, self._link, u, trace, i, inputs, walks)
        chain = [u for u in users if u.on_grad is not None and (u.when is None or u.when())]
        hook = Hook(chain, trace, i) if chain else None
        if isinstance(output, torch.Tensor):
            return self._wrap(output, trace, i, hook)
        return tree_map(lambda t: self._wrap(t, trace, i, hook), output)

    @staticmethod
    def _wrap(t: Any, trace: Trace, i: int, hook: "Hook | None") -> Any:
        """``t`` (an output of call ``i``) as the consumers' side of the boundary: a marked view
        with the call's transforms as its tensor hook; the module's own ops keep ``t``."""
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return t
        out = t.view_as(t)
        mark(out.grad_fn, 0, trace, i, hook, False)
        if t.grad_fn is not None:
            mark(t.grad_fn, t.output_nr, trace, i, hook, True)
        if hook is not None:
            out.register_hook(hook)
        return out
