"""Layer boundaries: the one place where anything hooks the activation gradients between layers.

A model's **layers** (:func:`layers`) are the names of its ``boundaries`` attribute when it
declares one, else every top-level child module that owns trainable parameters, looking inside
containers that are never called themselves (``ModuleList``, ``ModuleDict``), in registration
order — so ``embed``, ``blocks.0``, ``blocks.1``, ``ln_f``, ``head`` for a nanoGPT-style model.

Three kinds of user transform the gradient that leaves a layer's output on its way down in
backward, and :class:`Boundaries` applies them in this fixed, documented order:

1. ``"rescale"`` — per-layer strategies (``layerwise``): convert the gradient from the scale of
   the consumer's group to the producer's (an exact power-of-two ratio);
2. ``"quantize"`` — precision simulation (fp8): per-tensor cast scaling and quantise–dequantise,
   so the value is quantised at the scale the receiving layer computes with;
3. ``"observe"`` — telemetry: read-only measurements of what the layer below receives.

Each hooked module gets one forward hook, however many users; in every forward pass (with grad
enabled) a host-side :class:`Trace` records the hooked calls in order, and each call's tensor
outputs pass through one autograd node whose backward runs the users' transforms of that call in
stage order. So the result never depends on which user attached first (tested).
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

__all__ = ["STAGES", "Boundaries", "Trace", "layers"]

STAGES = ("rescale", "quantize", "observe")

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)

GradFn = Callable[["Trace", int, torch.Tensor], "torch.Tensor | None"]


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
            if isinstance(m, _CONTAINERS):  # never called itself: its members are
                visit(f"{prefix}{n}.", m)
            else:
                found.append(f"{prefix}{n}")

    visit("", model)
    return found


@dataclass
class Trace:
    """The hooked module calls of one forward pass, in order (host-side bookkeeping only)."""

    calls: list[torch.nn.Module] = field(default_factory=list)
    nodes: list[list[Any]] = field(default_factory=list)  # per call: the autograd nodes of its wrapped outputs
    finished: bool = False


@dataclass
class _User:
    stage: str
    modules: set[int]
    on_grad: GradFn | None
    on_call: Callable[[Trace, int], None] | None
    on_end: Callable[[Trace], None] | None
    when: Callable[[], bool] | None
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


class _Boundary(torch.autograd.Function):
    """Identity in forward; the users' transforms of one call, in stage order, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, chain: list[_User], trace: Trace, i: int) -> torch.Tensor:  # type: ignore[override]
        ctx.chain, ctx.trace, ctx.i = chain, trace, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        for u in ctx.chain:
            out = _timed(u, u.on_grad, ctx.trace, ctx.i, g)
            if out is not None:
                g = out
        return g, None, None, None


class Boundaries:
    """The hooks of one model, shared by every user (:meth:`of` returns the model's instance)."""

    _instances: "weakref.WeakKeyDictionary[torch.nn.Module, Boundaries]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Boundaries":
        inst = cls._instances.get(model)
        if inst is None:
            inst = cls._instances[model] = cls(model)
        return inst

    def __init__(self, model: torch.nn.Module) -> None:
        self._model_ref = weakref.ref(model)
        self._users: list[_User] = []
        self._hooks: dict[int, Any] = {}
        self._root_hooks: list[Any] = []
        self._disabled = 0
        self.trace: Trace | None = None

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
    ) -> Handle:
        """Call ``on_call(trace, i)`` at each call of one of ``modules`` (forward, grad enabled),
        ``on_end(trace)`` when the model's forward returns, and ``on_grad(trace, i, g)`` in
        backward with the gradient of call ``i``'s output (return a replacement or ``None``).
        ``when()``, if given, is asked at each call in forward: False leaves this call's gradient
        untouched by ``on_grad`` (decided in forward, so a backward run later agrees)."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        modules = list(modules)
        user = _User(stage, {id(m) for m in modules}, on_grad, on_call, on_end, when)
        self._users.append(user)
        self._users.sort(key=lambda u: STAGES.index(u.stage))  # stable: same stage keeps its order
        for m in modules:
            if id(m) not in self._hooks:
                self._hooks[id(m)] = m.register_forward_hook(self._on_output)
        model = self._model_ref()
        if model is not None and not self._root_hooks:
            self._root_hooks = [model.register_forward_pre_hook(self._start),
                                model.register_forward_hook(self._end)]
        return Handle(self, user)

    def _remove(self, user: _User) -> None:
        if user not in self._users:
            return
        self._users.remove(user)
        still = set().union(*(u.modules for u in self._users)) if self._users else set()
        for mid in list(self._hooks):
            if mid not in still:
                self._hooks.pop(mid).remove()
        if not self._users:
            for h in self._root_hooks:
                h.remove()
            self._root_hooks = []
            self.trace = None

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self.trace = None if self._disabled else Trace()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        trace = self.trace
        if trace is not None:
            trace.finished = True
            for u in list(self._users):
                if u.on_end is not None:
                    _timed(u, u.on_end, trace)
        self.trace = None

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._disabled or not torch.is_grad_enabled():
            return None
        if self.trace is None:  # the module was called outside the model's own forward
            self.trace = Trace()
        trace = self.trace
        i = len(trace.calls)
        trace.calls.append(module)
        users = [u for u in self._users if id(module) in u.modules]
        for u in users:
            if u.on_call is not None:
                _timed(u, u.on_call, trace, i)
        chain = [u for u in users if u.on_grad is not None and (u.when is None or u.when())]
        trace.nodes.append([])
        if not chain:
            return None

        def wrap(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                out = _Boundary.apply(t, chain, trace, i)
                trace.nodes[i].append(out.grad_fn)
                return out
            return t

        return tree_map(wrap, output)
