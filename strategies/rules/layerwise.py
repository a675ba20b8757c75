"""``layerwise``: one power-of-two scale per layer group, exact rescaling at group boundaries.

Rule (seed 003, section 3.3 "层级化动态缩放 (Layer-wise Scaling)": layers near the input usually
have smaller gradients than layers near the output, so each layer group l keeps its own scale
S_l). Groups are indexed 0..G-1; by default the model's layers
(:func:`strategies.model_layers.layers`: its declared ``boundaries``, else its children that own
parameters, opened down to its repeated blocks: one group per block of HF GPT-2, BERT, T5,
Llama, ViT), or the modules matched by ``groups`` (fnmatch patterns over qualified module names;
one group per pattern, outermost match, first pattern wins). Every trainable parameter must
belong to a group, and a group whose parameters receive gradients must have been called in
forward (:meth:`unscale_` raises otherwise: its gradients' scale would be unknown).

Mechanics (all scales are powers of two, so every rescaling is exact unless the result leaves the
format's range — which is precisely what scaling is about; the links and their maths:
:mod:`strategies.group_links`):

* :meth:`attach` registers the ``"rescale"`` stage of the model's layer boundaries
  (:mod:`strategies.boundaries`) on the group modules. The transform of a call of group a
  receives the gradient of its output at the scale of its consumer's group b and multiplies it by
  ``S_a / S_b``: a group's parameter gradients carry S_l. Transforms are per call (shared weights,
  recurrences), and only the graph matters, not the order groups are listed or registered in
  (models in a container listed [b, a] and called a then b).
* :meth:`scale` multiplies the loss by the scale of the group consuming what it consumes (the group
  nearest the loss); :meth:`get_scale` returns that scale. Several models feeding one loss, several
  losses (``retain_graph=True``), an auxiliary loss on an inner activation: all exact.
* The boundaries act only in a backward of a tensor :meth:`scale` returned
  (:class:`strategies.scaled_backwards.ScaledBackwards`): a plain ``loss.backward()`` (logging, an fp32
  reference) gives plain gradients.
* Gradient penalty (PyTorch's AMP examples): ``torch.autograd.grad(strategy.scale(loss), params,
  create_graph=True)`` returns each group's gradients at its own scale; unscale them with
  :meth:`unscale_grads`, not ``1 / get_scale()`` — :meth:`get_scale` and :meth:`unscale_` raise
  ``RuntimeError`` between such a backward and :meth:`unscale_grads`. Then
  ``strategy.scale(loss + penalty).backward()`` is exact.
* :meth:`unscale_` divides each group's parameter gradients by its own S_l.
* An output a later group reads again (T5's encoder output, read by every decoder block) is
  exact: that call's gradient into it is converted at its input to the first consumer's scale
  (:meth:`GroupLinks.fan_in`). A skip connection whose gradient would mix two scales (an input
  that also depends on an output consumed at another scale) is refused with one ``ValueError`` at
  the forward pass that does it, as is a grouped parameter used outside its group's module calls
  at another group's scale; a skip connection inside a group is exact. Tied weights: every
  module owning a grouped parameter is part of its group, groups sharing one merge (one warning,
  :mod:`strategies.layer_groups`). A model carrying another strategy's hooks is refused at
  :meth:`attach`. Not supported: reentrant activation checkpointing inside groups;
  ``copy.deepcopy`` of an attached model (detach first).

Update (per group, in place, no host sync):

* ``rule="max_ema"`` (default): :func:`strategies.rules.max_ema.max_ema_update_` elementwise over the
  groups with each group's abs-max, rounded down to powers of two; ``rule="backoff_growth"``:
  torch's backoff/growth per group (:func:`strategies.rules.native.native_update_`).
* Any non-finite gradient skips the whole step. Only the groups where the overflow *originated*
  back off; the other groups keep their scale and EMA (their growth tracker restarts, as the
  step was skipped). Attribution: each boundary hook checks its incoming gradient; a
  non-finite one there marks the group above as having *emitted* it and the group below as
  *contaminated*. Origin = (own parameter gradients non-finite, or emitted non-finite) and not
  contaminated. If no group qualifies (an overflow on a path the hooks do not see), all back off.
* A group whose parameters got no gradient this step keeps its state.

Without :meth:`attach` it is a single-group strategy (max-EMA with power-of-two scales);
:meth:`detach` removes every hook and returns to one group at the loss-side scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from strategies import group_links, layer_groups, validation as v
from strategies.base import Strategy
from strategies.boundaries import Boundaries, Trace
from strategies.graph_walk import fence
from strategies.host_index import host_tensor
from strategies.group_links import GroupLinks
from strategies.params import ScalerParams, hp
from strategies.schedule import StatsSchedule, hold_update_, stats_step
from strategies.registry import register_strategy
from strategies.rules import adaloss
from strategies.rules.layerwise_update import RULES, layerwise_update_
from strategies.rules.max_ema import MaxEmaRule
from strategies.sharding import refuse_flat_params
from strategies.scaled_backwards import ScaledBackwards
from strategies.state import State
from strategies.stats import GradStats, extremes, nonfinite

__all__ = ["LayerwiseParams", "LayerwiseStrategy", "RULES", "layerwise_update_"]

def _is_pow2(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


@dataclass
class LayerwiseParams(MaxEmaRule, StatsSchedule, ScalerParams):
    init_scale: float = hp(2.0**15, v.finite_positive, "seed 003 §3.1",
                           "every group's initial scale, a power of two")
    growth_interval: Optional[int] = hp(None, v.optional(v.integer(1)), "scalelab",
                                        "None = 1 for rule max_ema, 2000 for rule backoff_growth")
    groups: Optional[List[str]] = hp(None, v.patterns, "scalelab",
                                     "fnmatch patterns over module names, one group per pattern (None = the layers)")
    rule: str = hp("max_ema", v.choice(*RULES), "seed 003 §3.3; AdaLoss", "the per-group rule")
    underflow_rate: float = hp(1e-3, v.between(0.0, 1.0), "AdaLoss n_uf_threshold", "adaloss: target underflow rate")
    format_min: float = hp(6.0e-8, v.finite_positive, "AdaLoss u_min (fp16)", "adaloss: smallest value of the format")
    layer_cap: float = hp(16.0, v.above(1.0), "AdaLoss scale_upper_bound", "adaloss: largest factor per group")
    total_cap: float = hp(1024.0, v.above(1.0), "AdaLoss accum_upper_bound", "adaloss: largest cumulative scale")

    def check(self) -> None:
        super().check()
        if self.stats_layers != 1.0:
            v.fail("stats_layers", "1.0 for layerwise (each group's scale needs its own group's statistics)",
                   self.stats_layers)
        if self.growth_interval is None:
            self.growth_interval = 2000 if self.rule == "backoff_growth" else 1
        if not _is_pow2(self.init_scale):  # refused, not rounded: the record would name a scale never used
            low = 2.0 ** math.floor(math.log2(self.init_scale))
            v.fail("init_scale", f"a power of two, e.g. {low!r} or {2 * low!r} (group scales are powers of two so "
                   "that boundary rescaling is exact)", self.init_scale)
        lo, hi = self.pow2_bounds
        if lo is not None and hi is not None and lo > hi:
            v.fail("max_scale", f"a bound leaving a power of two in [min_scale={self.min_scale:g}, max_scale]",
                   self.max_scale)

    @property
    def pow2_bounds(self) -> tuple[float | None, float | None]:
        """The powers of two inside [min_scale, max_scale] (None: unbounded)."""
        lo = None if self.min_scale is None else 2.0 ** math.ceil(math.log2(self.min_scale))
        hi = None if self.max_scale is None else 2.0 ** math.floor(math.log2(self.max_scale))
        return lo, hi


def _adaloss(params: LayerwiseParams) -> bool:
    return params.rule == "adaloss"


def _per_group(name: str, dtype: torch.dtype, init: float, saved: bool = True, low: float | None = None) -> State:
    return State(name, dtype, init, per_group=True, saved=saved, low=low)


@register_strategy("layerwise")
class LayerwiseStrategy(Strategy):
    """Per-layer-group power-of-two scales with exact boundary rescaling (seed 003, section 3.3;
    mechanics in the module docstring). ``attach(model)`` installs the boundary transforms."""

    Params = LayerwiseParams
    needs_stats = True
    per_group = True
    pow2_scales = True
    state_spec = (
        _per_group("ema", torch.float32, 0.0),
        _per_group("ema_steps", torch.int32, 0, low=0),
        _per_group("hysteresis", torch.int32, 1),
        _per_group("candidate", torch.float32, math.nan, saved=False),
        _per_group("overflow_origin", torch.float32, 0.0, saved=False),
        State("emitted", torch.float32, 0.0, per_group=True, saved=False, reduce="max"),
        State("contaminated", torch.float32, 0.0, per_group=True, saved=False, reduce="max"),
        *(State(n, torch.float32, 0.0, per_group=True, saved=False, when=_adaloss, reduce=op)
          for n, op in (("ada_g2", "sum"), ("ada_n", "sum"), ("ada_gmax", "max"))),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._links = GroupLinks(["all"], {})  # the groups of the current attach (a new object per attach)
        self._param_group: dict[int, int] = {}
        self._weight_stats: tuple[Any, adaloss.WeightStats] | None = None
        self._weights: list[list[torch.Tensor]] = [[]]  # per group, for rule adaloss
        self._handle: Any = None
        self._boundaries: Boundaries | None = None
        self._scaled = ScaledBackwards()
        self._unscale_pending = False  # a create_graph backward crossed a boundary since unscale_grads
        self._crossings: list[tuple[int, int, torch.Tensor]] = []  # (a, b, extremes) since the last flush
        self._seen: list[Any] = []  # rule adaloss: (a, b, adaloss.observe(...)) since the last flush
        self._ratios: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None  # (scale, key, S_a / S_b)

    # ------------------------------------------------------------------ groups
    @property
    def num_groups(self) -> int:
        return len(self._links.names)

    @property
    def group_names(self) -> list[str]:
        return list(self._links.names)

    def attach(self, model: torch.nn.Module) -> "LayerwiseStrategy":
        """Split ``model`` into groups and register the boundary rescaling (replacing an earlier
        attach). Raises ``ValueError`` if a trainable parameter belongs to no group, or if the
        model still carries another strategy's hooks (``detach()`` that one first)."""
        self.detach()
        if not self.params.enabled:
            return self
        refuse_flat_params(model, self.name)
        resolved, param_group = layer_groups.assign(model, self.params.groups)
        modules = [m for _, mods in resolved for m in mods]
        links = GroupLinks([n for n, _ in resolved], {id(m): gi for gi, (_, mods) in enumerate(resolved) for m in mods},
                           param_group, {id(p): n for n, p in model.named_parameters()})
        if modules:
            boundaries = Boundaries.of(model)
            self._handle = boundaries.register(
                "rescale", modules,
                on_grad=lambda trace, i, g: self._rescale(links, trace, i, g),
                on_link=lambda trace, i, below, leaves: self._link(links, trace, i, below, leaves),
                on_inputs=lambda module, t, below: self._fan_in(links, module, t, below),
                owner=self,
            )
            self._boundaries = boundaries
        self._links = links
        self._param_group = param_group
        self._weights = [list({id(p): p for m in mods for p in m.parameters()}.values()) for _, mods in resolved]
        self.regroup_()
        self.output_group = len(resolved) - 1
        return self

    def detach(self) -> None:
        """Remove the boundary transforms; back to one group at the current loss-side scale."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._boundaries = None
        self._unscale_pending = False
        self._crossings, self._seen = [], []
        if self.num_groups > 1 or self._param_group:
            self._links = GroupLinks(["all"], {})
            self._param_group, self._weights = {}, [[]]
            self.regroup_()
        else:  # a new object all the same: the callbacks of the last attach stop acting
            self._links = GroupLinks(self._links.names, self._links.module_group)

    # ------------------------------------------------------------------ forward / backward
    def _link(self, links: GroupLinks, trace: Trace, i: int, below: list[tuple[Trace, int]], leaves: list) -> None:
        """A group call in forward, of the current attach: :meth:`GroupLinks.on_call` and ``on_link``."""
        if links is self._links:
            links.on_call(trace, i, self.updates)
            links.on_link(trace, i, below, leaves)

    def before_scale(self, outputs: Any) -> None:
        """Attached: choose the loss-side group for ``outputs`` (:meth:`GroupLinks.place_loss`),
        and so the scale :meth:`scale` multiplies by."""
        if self._handle is None:
            return
        trace = self._boundaries.trace if self._boundaries is not None else None
        group = self._links.place_loss(outputs, trace)
        if group is not None:
            self.output_group = group

    def after_scale(self, scaled: Any) -> Any:
        """Attached: the boundaries rescale only the backwards of what :meth:`scale` returns."""
        return scaled if self._handle is None else self._scaled.mark(scaled)

    def _acting(self, links: GroupLinks) -> bool:
        """In a backward of a loss that went through :meth:`scale`, and of the current attach."""
        return links is self._links and self.state is not None and self._scaled.active()

    def _rescale(self, links: GroupLinks, trace: Trace, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Gradient of call i (group a), at the scale of the group b consuming it: x S_a / S_b."""
        if not self._acting(links):
            return None
        a, b, trace_links = links.ends(trace, i)
        adaloss_rule = self.params.rule == "adaloss"
        out, ext = self._convert(trace_links, a, b, grad) if a != b else (None, extremes(grad) if adaloss_rule else None)
        if adaloss_rule and stats_step(self):  # the gradient arriving at group a's output, unscaled
            self._seen.append((a, b, adaloss.observe(grad, ext)))
        return out

    def _fan_in(self, links: GroupLinks, module: torch.nn.Module, t: torch.Tensor,
                below: list[tuple[Trace, int]]) -> torch.Tensor | None:
        """Before a call of group b: an argument (consuming the group calls ``below``) whose
        gradient must arrive at another group a's scale (:meth:`GroupLinks.fan_in`) is fenced, and
        the call's gradient into it x S_a / S_b."""
        found = links.fan_in(module, below) if links is self._links else None
        if found is None:
            return None
        a, b, trace_links = found
        return fence(t, lambda g: self._convert(trace_links, a, b, g)[0] if self._acting(links) else None)

    def _convert(self, trace_links: group_links.Links, a: int, b: int,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A gradient at group b's scale entering group a's side: x S_a / S_b, and its
        :func:`strategies.stats.extremes`, in one read (:func:`strategies.group_links.rescale_read`);
        a non-finite one marks a contaminated and b as having emitted it (overflow attribution)."""
        if torch.is_grad_enabled():  # create_graph: a gradient penalty differentiates this backward
            self._unscale_pending = True
        ratios = self._ratio_table()
        out, ext = group_links.rescale_read(trace_links, grad, ratios, a * ratios.shape[1] + b)
        self._crossings.append((a, b, ext))
        return out, ext

    def _ratio_table(self) -> torch.Tensor:
        """``S_a / S_b`` for every pair ``[a, b]``, computed once per value of the scales (one
        division per update instead of three ops per boundary crossing). The value is known by
        the scale tensor, the update count (the update ops write it without bumping its version)
        and its version (a Python write: ``load_state_dict``, ``update(new_scale)``)."""
        scale = self.state.scale
        key = (self.updates, scale._version)
        if self._ratios is None or self._ratios[0] is not scale or self._ratios[1] != key:
            self._ratios = (scale, key, scale[:, None] / scale[None, :])
        return self._ratios[2]

    def _flush_crossings(self) -> None:
        """The overflow attribution of the crossings since the last flush, in one go: a non-finite
        gradient crossing from group b into group a (:func:`strategies.stats.nonfinite` of its
        extremes) marks a contaminated and b as having emitted it. Run when the gradients are
        unscaled (before a cross-rank reduction of the marks) and at the update."""
        s = self.state
        if self._seen:  # rule adaloss: the gradients arriving at the groups' outputs
            adaloss.record_(s.ada_g2, s.ada_n, s.ada_gmax, s.scale, self._seen)
            self._seen = []
        if not self._crossings:
            return
        below, above, ext = zip(*self._crossings)
        self._crossings = []
        bad = nonfinite(torch.stack(ext))
        s.contaminated.scatter_reduce_(0, host_tensor(below, torch.int64, bad.device), bad, "amax")
        s.emitted.scatter_reduce_(0, host_tensor(above, torch.int64, bad.device), bad, "amax")

    def on_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self._flush_crossings()

    # ------------------------------------------------------------------ gradient penalty
    def unscale_grads(self, grads: Sequence[torch.Tensor | None],
                      params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients ``torch.autograd.grad(strategy.scale(loss), params, create_graph=True)``
        returned, at scale 1: each divided by its own group's scale S_l (GradScaler's recipe
        multiplies by ``1 / get_scale()``, which is only the loss-side group's). Differentiable,
        for a gradient penalty, and exact: then ``strategy.scale(loss + penalty).backward()``
        gives every group's parameters ``S_l * d(loss + penalty)/dp`` (tested against GradScaler;
        the maths: :mod:`strategies.group_links`)."""
        state = self._check_initialized("unscale_grads")
        grads, params = list(grads), list(params)
        if len(grads) != len(params):
            raise ValueError(f"unscale_grads: grads and params must have the same length, got {len(grads)} "
                             f"and {len(params)}")
        index = self.group_index(params) or [0] * len(params)
        self._unscale_pending = False
        return group_links.unscale(grads, index, state.scale, self.output_scale())

    def guard(self, what: str) -> None:
        """:meth:`get_scale` and :meth:`unscale_` are refused (``RuntimeError``) between a
        create_graph backward and :meth:`unscale_grads`, where ``1 / get_scale()`` would unscale
        groups wrongly."""
        if self._unscale_pending:
            raise RuntimeError(
                f"layerwise: {what} after a create_graph backward (gradient penalty): its gradients come back at "
                "each group's own scale, not at the loss-side get_scale(); unscale them with "
                "strategy.unscale_grads(grads, params) (docs/strategy-api.md)")

    def group_index(self, params: list[torch.Tensor]) -> list[int] | None:
        """Each parameter's group. Refuses gradients whose scale is unknown: a group whose
        parameters received gradients but whose modules were not called (with grad enabled) since
        the last update. Host-side (Python sets), no tensor read."""
        if not self._param_group:
            return None
        try:
            index = [self._param_group[id(p)] for p in params]
        except KeyError:
            raise ValueError("layerwise: the optimizer holds a parameter outside the attached model") from None
        if self._handle is not None and self.num_groups > 1:
            self._links.refuse_uncalled(index, self.updates)
        return index

    # ------------------------------------------------------------------ the rule
    def hold_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        """Between statistic steps (``stats_every``, :mod:`strategies.schedule`): on an overflow
        the groups it is blamed on back off (every group's growth tracker restarts), else nothing
        changes. No host sync."""
        assert stats is not None  # the grouped pass runs every step
        self._flush_crossings()
        s = self.state
        origin = layer_groups.overflow_origin(found_inf, stats.found_inf, s.emitted, s.contaminated)
        blamed = torch.where(origin, s.scale, torch.zeros_like(s.scale))
        hold_update_(blamed, s.growth_tracker, found_inf, self.params.backoff_factor)
        s.scale.copy_(torch.where(origin, blamed, s.scale))
        s.overflow_origin.copy_(origin)
        self._unscale_pending = False
        s.contaminated.zero_()
        s.emitted.zero_()

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        self._flush_crossings()
        p, s = self.params, self.state
        lo, hi = p.pow2_bounds
        if p.rule == "adaloss":
            key = (self._links, s.scale.device)
            if self._weight_stats is None or self._weight_stats[0] != key:  # built once per attach
                self._weight_stats = (key, adaloss.WeightStats(self._weights, s.scale.device))
            w2, wmax, fan = self._weight_stats[1]()
            self.run_update("adaloss_step_", adaloss.adaloss_step_, scales=s.scale, origin=s.overflow_origin,
                            g2=s.ada_g2, n=s.ada_n, gmax=s.ada_gmax, found_inf=found_inf, group_found_inf=stats.found_inf,
                            w2=w2, wmax=wmax, fan=fan, quantile=adaloss.quantile(p.underflow_rate), u_min=p.format_min,
                            u_max=p.format_max, min_scale=lo, max_scale=hi)
        else:
            self.run_update("layerwise_update_", layerwise_update_, scales=s.scale, growth_trackers=s.growth_tracker,
                            origin=s.overflow_origin, found_inf=found_inf, group_found_inf=stats.found_inf,
                            group_absmax=stats.absmax, group_numel=stats.numel, grow_on_zero=p.zero_grads == "grow",
                            min_scale=lo, max_scale=hi)
        self._unscale_pending = False
        if self._handle is not None:  # only the boundary hooks write them
            s.contaminated.zero_()
            s.emitted.zero_()
