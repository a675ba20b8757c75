"""Exact rescaling links between the layer groups of a per-group strategy (``layerwise``).

Each group l keeps its own power-of-two scale S_l, so every rescaling below is exact unless the
result leaves the format's range (seed 003, section 3.3):

* At every group call the graph between the call's tensor arguments and the earlier group calls
  is walked (:func:`strategies.boundaries.reached`): the group of a call's *consumer* is recorded
  (:meth:`GroupLinks.on_link`, :func:`link`). In backward the ``"rescale"`` boundary of a call of
  group a receives the gradient of its output at the scale of its consumer's group b and
  multiplies it by ``S_a / S_b`` (:func:`rescale`; in float32, cast back to the gradient's
  dtype). Hence a group's parameter gradients carry S_l, and the glue ops between two group calls
  work at the scale of the consuming group. Links are per call, so a module called several times
  (shared weights, recurrences) is handled, and the order in which groups are listed or
  registered does not matter: only the graph does.
* The loss is placed (:meth:`GroupLinks.place_loss`) by walking from it to the calls it consumes
  directly: it is scaled by the scale of their consumer group (the group already consuming one of
  them, else the group of the latest: the group nearest the loss). Several models feeding one
  loss, several losses (``retain_graph=True``), an auxiliary loss on an inner activation at the
  scale of the group consuming it: all exact.
* An output read again by a later call of another group c (T5's encoder output, read by every
  decoder block) is exact: before that call, an argument that consumes only outputs already
  consumed at one group a's scale is fenced (:meth:`GroupLinks.fan_in`), and the gradient the
  call sends into it is multiplied by ``S_a / S_c`` there, so the ops below keep a's scale.
  Any other output consumed at two scales (an argument that mixes it with outputs consumed
  elsewhere, a loss scaled at another group's scale: a skip connection across a group boundary)
  is refused with one ``ValueError`` (:func:`link`) at the forward pass that does it; a skip
  connection inside a group is exact. So is a grouped parameter that the ops between group calls
  use at another group's scale (:meth:`GroupLinks.refuse_glue`).
* Gradient penalty: in a create_graph backward each boundary returns ``g * S_a/S_b`` with
  derivative 1 (:class:`StraightThrough`), and :func:`unscale` returns each parameter gradient
  ``g / S_l`` with derivative ``1 / S_out`` (``S_out`` the loss-side scale): in the second
  backward the adjoint of every first-backward gradient is then its derivative at scale 1, so
  what flows from it into the forward activations of group l carries ``S_l``, the scale the
  boundaries expect there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from strategies.boundaries import Trace
from strategies import kernels
from strategies.graph_walk import reached, tensors_in
from strategies.stats import extremes

__all__ = ["GroupLinks", "Links", "StraightThrough", "Unscale", "link", "rescale", "rescale_read", "times", "unscale"]


def times(g: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``g * ratio``; for fp16/bf16/fp8 in float32 and cast back (the ratio may not fit the format)."""
    if g.dtype.itemsize < 4:
        return (g.float() * ratio).to(g.dtype)
    return g * ratio.to(g.dtype)


class StraightThrough(torch.autograd.Function):
    """``g * ratio`` whose derivative with respect to ``g`` is taken as 1 (the boundary in a
    create_graph backward; the module docstring states why)."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return times(g, ratio)

    @staticmethod
    def backward(ctx: Any, c: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return c, None


class Unscale(torch.autograd.Function):
    """``g * inv`` whose derivative with respect to ``g`` is ``inv_out`` (see :func:`unscale`)."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, inv: torch.Tensor, inv_out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv_out)
        return times(g, inv)

    @staticmethod
    def backward(ctx: Any, c: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (inv_out,) = ctx.saved_tensors
        return times(c, inv_out), None, None


@dataclass
class Links:
    """What one forward pass (a :class:`strategies.boundaries.Trace`) told a per-group strategy:
    for each call, the group whose scale the gradient of its output arrives at (the group of the
    calls that consume it, or the loss's group for an output the loss consumes directly)."""

    consumer: dict[int, int] = field(default_factory=dict)
    loss_group: int | None = None
    double: bool = False  # a create_graph backward ran through it (gradient penalty)


def link(links: Links, k: int, group: int, producer: str | Callable[[], str], by: str | Callable[[], str],
         names: list[str]) -> None:
    """Record that call ``k`` (of group ``producer``) is consumed by ``group`` (``by`` names the
    consumer); refuse a second consumer of another group with one ``ValueError``. ``producer`` and
    ``by`` may be callables returning the names, made only for the error (every group call links)."""
    old = links.consumer.setdefault(k, group)
    if old != group:
        producer = producer() if callable(producer) else producer
        by = by() if callable(by) else by
        raise ValueError(
            f"layerwise: the output of group {producer!r} is also consumed by {by}, past group {names[old]!r} "
            "(a skip connection across a group boundary): its gradient would mix two scales. Pass groups=[...] "
            f"patterns that put the layers from {names[old]!r} to {names[group]!r} in one group")


class GroupLinks:
    """The groups of one ``attach`` (their names, the group of each hooked module) and what the
    forward passes told about them: the :class:`Links` of each trace (keyed by this object in
    ``trace.data``) and the groups called since the last update."""

    def __init__(self, names: list[str], module_group: dict[int, int], param_group: dict[int, int] | None = None,
                 param_names: dict[int, str] | None = None) -> None:
        self.names = names
        self.module_group = module_group
        self.param_group, self.param_names = param_group or {}, param_names or {}
        self.called: set[int] = set()
        self.called_at = -1  # the update the called groups belong to

    def links(self, trace: Trace) -> Links:
        links = trace.data.get(self)
        if links is None:
            links = trace.data[self] = Links()
        return links

    def group_of(self, trace: Trace, i: int) -> int:
        return self.module_group[id(trace.calls[i])]

    def mine(self, trace: Trace, i: int) -> bool:
        return id(trace.calls[i]) in self.module_group

    def on_call(self, trace: Trace, i: int, updates: int) -> None:
        """Call i ran in forward during update number ``updates``: its group has a known scale."""
        if self.called_at != updates:
            self.called, self.called_at = set(), updates
        self.called.add(self.group_of(trace, i))

    def on_link(self, trace: Trace, i: int, below: list[tuple[Trace, int]], leaves: list[torch.Tensor]) -> None:
        """Call i's tensor arguments consume the outputs of ``below`` (and ``leaves``, through the
        ops between): their gradient arrives at call i's group's scale."""
        g = self.group_of(trace, i)
        for tr, k in below:
            link(self.links(tr), k, g, lambda: self.names[self.group_of(tr, k)], lambda: f"group {self.names[g]!r}",
                 self.names)
        if leaves:
            self.refuse_glue(leaves, g)

    def refuse_glue(self, leaves: list[torch.Tensor], g: int) -> None:
        """Raise ``ValueError`` for a grouped parameter of another group than g used by the ops
        whose gradient carries g's scale, outside the calls of its group's modules (``F.linear(x,
        self.wte.weight)`` in a parent's forward; the members of a group that is a ModuleList):
        its gradient would mix two scales."""
        for p in leaves:
            own = self.param_group.get(id(p), g)
            if own != g:
                raise ValueError(
                    f"layerwise: parameter {self.param_names.get(id(p), '?')!r} (group {self.names[own]!r}) is used "
                    f"outside the calls of its group's modules, by ops at group {self.names[g]!r}'s scale (a "
                    "functional use in a parent's forward, or a group of modules never called themselves, such as a "
                    "ModuleList): its gradient would mix two scales. Use it through a module that owns it, or pass "
                    "groups=[...] patterns of modules that are called, with such a parent in one group")

    def fan_in(self, module: torch.nn.Module, found: list[tuple[Trace, int]]) -> tuple[int, int, Links] | None:
        """Before a call of ``module`` (group b) with an argument that consumes the outputs of the
        group calls ``found`` (the boundaries' walk from it, :func:`reached`): ``(a, b, links)`` when
        those outputs' gradient already arrives at one other group a's scale (an output an earlier
        group consumes: T5's encoder output, read by every decoder block), so the gradient the call
        sends into the argument must be converted by S_a / S_b; else None (the links recorded after
        the call decide, and refuse a mix)."""
        b = self.module_group[id(module)]
        consumers = {self.links(tr).consumer.get(k) for tr, k in found}
        if len(consumers) != 1 or None in consumers or b in consumers:
            return None
        return consumers.pop(), b, self.links(found[0][0])

    def place_loss(self, outputs: Any, trace: Trace | None) -> int | None:
        """The loss-side group for ``outputs`` (``trace``: the current one): the group already
        consuming a call the loss consumes directly, else the group of the latest such call; None
        to keep the current one (no call reached). After a create_graph backward (gradient
        penalty) the trace keeps the group of its first loss (the graph now also reaches the calls
        through that backward)."""
        current = trace.data.get(self) if trace is not None else None
        if current is not None and current.double:
            return current.loss_group
        leaves: list[torch.Tensor] = []
        found = reached(tensors_in(outputs), self.mine, leaves)
        if not found:
            return None
        labels = [self.links(tr).consumer[k] for tr, k in found if k in self.links(tr).consumer]
        if labels:
            group = labels[0]
        else:
            latest = found[-1] if trace is None else max(found, key=lambda c: (c[0] is trace, c[1]))
            group = self.group_of(*latest)
        by = f"the loss given to scale() (at group {self.names[group]!r}'s scale)"
        for tr, k in found:
            link(self.links(tr), k, group, self.names[self.group_of(tr, k)], by, self.names)
            self.links(tr).loss_group = group
        self.refuse_glue(leaves, group)
        return group

    def ends(self, trace: Trace, i: int) -> tuple[int, int, Links]:
        """``(a, b, links)``: the group of call i, the group whose scale its output's gradient
        arrives at, and the trace's :class:`Links`. Raises ``RuntimeError`` when no consumer was
        recorded (an op the boundaries did not see)."""
        a = self.group_of(trace, i)
        links = trace.data.get(self)
        b = None if links is None else links.consumer.get(i)
        if b is None:
            raise RuntimeError(
                f"layerwise: a gradient reaches the output of group {self.names[a]!r} from an op the "
                "boundaries did not see (neither a tensor argument of a group module nor the loss given to "
                "scale()), so its scale is unknown; scale the whole loss with strategy.scale(loss)")
        return a, b, links

    def refuse_uncalled(self, index: list[int], updates: int) -> None:
        """Raise ``RuntimeError`` for a group in ``index`` (groups with gradients) none of whose
        modules was called in forward during update ``updates``: their scale is unknown."""
        called = self.called if self.called_at == updates else set()
        for gi in sorted(set(index) - called):
            raise RuntimeError(
                f"layerwise: group {self.names[gi]!r} has gradients but none of its "
                "modules was called in forward since the last update, so their scale is "
                "unknown; choose groups (patterns) of modules that are called")


def rescale(links: Links, grad: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``grad * ratio`` at a boundary (:func:`times`); in a create_graph backward (a gradient
    penalty differentiates it) with derivative 1, and ``links`` remembers that backward."""
    if torch.is_grad_enabled():
        links.double = True
        return StraightThrough.apply(grad, ratio)
    return times(grad, ratio)


def rescale_read(links: Links, grad: torch.Tensor, ratios: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad * r, extremes(grad))`` with ``r = ratios.flatten()[index]``: a boundary crossing's
    rescale (:func:`rescale`) and its overflow check (:func:`strategies.stats.extremes` of the
    gradient as it arrived) in one read of ``grad`` (``torch.ops.scalelab.boundary_rescale``)
    where it applies (:func:`strategies.kernels.boundary_applies`: not in a create_graph
    backward), else the two in plain torch; the same values either way (tested)."""
    if not torch.is_grad_enabled() and kernels.boundary_applies("boundary_rescale", grad):
        return torch.ops.scalelab.boundary_rescale(grad, ratios, index)
    return rescale(links, grad, ratios.view(-1)[index]), extremes(grad)


def unscale(grads: Sequence[torch.Tensor | None], index: list[int], scales: torch.Tensor,
            out_scale: torch.Tensor) -> list[torch.Tensor | None]:
    """Each gradient divided by its own group's scale (``index[j]`` the group of ``grads[j]``),
    differentiable with derivative ``1 / out_scale`` (module docstring: gradient penalty)."""
    inv = 1.0 / scales.reshape(-1).float()
    inv_out = 1.0 / out_scale.float()
    return [None if g is None else Unscale.apply(g, inv[gi], inv_out) for g, gi in zip(grads, index)]
