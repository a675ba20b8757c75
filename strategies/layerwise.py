"""``layerwise``: one power-of-two scale per layer group, exact rescaling at group boundaries.

Rule (seed 003, section 3.3 "层级化动态缩放 (Layer-wise Scaling)": layers near the input usually
have smaller gradients than layers near the output, so each layer group l keeps its own scale
S_l). Groups are indexed 0..G-1; by default each top-level child module of the attached model
that owns parameters (registration order; containers that are never called themselves —
``ModuleList``, ``ModuleDict`` — are looked into, so ``blocks.0``, ``blocks.1``, ... are groups),
or the modules matched by ``groups`` (fnmatch patterns over qualified module names; one group
per pattern, outermost match, first pattern wins). Every trainable parameter must belong to a
group, and a group whose parameters receive gradients must have been called in forward
(:meth:`unscale_` raises otherwise: its gradients' scale would be unknown).

Mechanics (all scales are powers of two, so every rescaling below is exact unless the result
leaves the format's range — which is precisely what scaling is about):

* :meth:`attach` puts a forward hook on each group module. In every forward pass it records the
  sequence of group *calls* and registers a tensor hook on each call's output. In backward the
  hook of call i (group a) receives the gradient of everything downstream of it, which is at
  the scale of the next call's group b (the loss side), and multiplies it by ``S_a / S_b`` (in
  float32, cast back to the gradient's dtype). Hence a group's parameter gradients carry S_l,
  and the glue ops between two group calls work at the scale of the later group. Because hooks
  are per call, a module called several times (shared weights, recurrences) is handled: each
  call converts to its successor's scale.
* :meth:`scale` multiplies the loss by the scale of the group called last in the latest forward
  (the group nearest the loss); :meth:`get_scale` returns that scale.
* :meth:`unscale_` divides each group's parameter gradients by its own S_l (``_inv_scales``).
* Assumption: the group calls form a chain, i.e. what consumes call i's output lies between it
  and call i+1 (sequential models, blocks with internal residuals). A skip connection that
  jumps over a group boundary mixes scales. Not supported: activation checkpointing inside
  groups, tied weights across groups, computing the loss from a non-final group's output.
  ``copy.deepcopy`` of an attached model copies the hooks too: detach first.

Update (per group, in place, no host sync):

* ``rule="max_ema"`` (default): :func:`strategies.max_ema.max_ema_update_` elementwise over the
  groups with each group's abs-max, rounded down to powers of two; ``rule="backoff_growth"``:
  torch's backoff/growth per group (:func:`strategies.native.native_update_`).
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

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.max_ema import FP16_MAX, max_ema_update_, round_down_pow2, validate_max_ema_rule
from strategies.native import native_update_
from strategies.registry import register_strategy
from strategies.stats import GradStats

RULES = ("max_ema", "backoff_growth")


def layerwise_update_(
    scales: torch.Tensor,
    growth_trackers: torch.Tensor,
    ema: torch.Tensor,
    ema_steps: torch.Tensor,
    hysteresis: torch.Tensor,
    candidate: torch.Tensor,
    origin: torch.Tensor,
    found_inf: torch.Tensor,
    group_found_inf: torch.Tensor,
    group_absmax: torch.Tensor,
    group_numel: torch.Tensor,
    emitted: torch.Tensor,
    contaminated: torch.Tensor,
    rule: str,
    target_max: float,
    ema_decay: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    grow_on_zero: bool,
    min_scale: float | None,
    max_scale: float | None,
    cap_ema_on_overflow: bool = False,
) -> None:
    """The per-group rule, in place on the device (no host sync). Every tensor has shape [G]
    except ``found_inf`` (scalar: > 0 when any gradient of the step was non-finite).

    Args:
        scales (float32), growth_trackers (int32), ema (float32), ema_steps (int32),
            hysteresis (int32, ``backoff_growth``'s tracker, H = 1): the per-group state; updated.
        candidate: float32, written with each group's ``target_max / absmax`` (``max_ema``).
        origin: float32, written with 1.0 for the groups blamed for this step's overflow.
        group_found_inf, group_absmax, group_numel: the step's per-group statistics.
        emitted, contaminated: float32, > 0 where a boundary hook saw a non-finite gradient
            leave the group downward / arrive into it from above.
        rule: ``"max_ema"`` or ``"backoff_growth"``; other arguments: hyper-parameters;
            ``min_scale``/``max_scale`` are the power-of-two bounds (None: unbounded).

    Origin = (own gradients non-finite or emitted non-finite) and not contaminated, on a
    skipped step; if no group qualifies, every group. Origin groups run the rule with
    found_inf = 1 (back off, EMA not fed). Groups that are not origins on a skipped step, and
    groups that received no gradient, keep their state; every tracker restarts on a skipped step.
    New scales are rounded down to powers of two and clamped.
    """
    skip = found_inf > 0
    blamed = ((group_found_inf > 0) | (emitted > 0)) & ~(contaminated > 0) & skip
    blamed = blamed | (skip & ~blamed.any())
    frozen = (skip & ~blamed) | (group_numel == 0)
    old = [t.clone() for t in (scales, growth_trackers, ema, ema_steps, hysteresis)]
    if rule == "max_ema":
        max_ema_update_(scales, ema, ema_steps, growth_trackers, candidate, blamed.float(), group_absmax,
                        target_max, ema_decay, growth_factor, backoff_factor, growth_interval, True, grow_on_zero,
                        cap_ema_on_overflow)
    elif rule == "backoff_growth":
        native_update_(scales, growth_trackers, hysteresis, blamed.float(),
                       growth_factor, backoff_factor, growth_interval, 1)
        scales.copy_(round_down_pow2(scales))
    else:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    for t, o in zip((scales, growth_trackers, ema, ema_steps, hysteresis), old):
        t.copy_(torch.where(frozen, o, t))
    growth_trackers.copy_(torch.where(skip, torch.zeros_like(growth_trackers), growth_trackers))
    if min_scale is not None or max_scale is not None:
        scales.clamp_(min=min_scale, max=max_scale)
    origin.copy_(blamed.float())


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
"""Modules that hold others but are never called: the default grouping looks inside them."""


def _is_pow2(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


@dataclass
class _Trace:
    """The group calls of one forward pass (host-side bookkeeping only)."""

    generation: int
    calls: list[int] = field(default_factory=list)
    out_group: int | None = None


@register_strategy("layerwise")
class LayerwiseStrategy(Strategy):
    """Per-layer-group power-of-two scales with exact boundary rescaling (seed 003, section 3.3;
    mechanics in the module docstring).

    Args:
        init_scale: initial scale of every group, a power of two (default 2^15).
        growth_interval: default ``None`` = 1 for ``rule="max_ema"`` and 2000 for
            ``"backoff_growth"``.
        groups: fnmatch patterns over qualified module names, one group per pattern
            (default ``None``: each top-level child module that owns parameters).
        rule: ``"max_ema"`` (default) or ``"backoff_growth"`` (torch's rule per group).
        target_max, format_max, ema_decay, zero_grads, cap_ema_on_overflow: the max-EMA rule's parameters
            (see :class:`strategies.max_ema.MaxEmaStrategy`).
        min_scale, max_scale: bounds; the effective bounds are the powers of two inside them.
        other arguments: see :class:`strategies.base.Strategy`.
    """

    needs_stats = True

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int | None = None,
        enabled: bool = True,
        *,
        groups: Sequence[str] | None = None,
        rule: str = "max_ema",
        target_max: float = 32768.0,
        format_max: float = FP16_MAX,
        ema_decay: float = 0.99,
        zero_grads: str = "grow",
        cap_ema_on_overflow: bool = False,
        **kwargs: Any,
    ) -> None:
        rule = v.one_of("rule", rule, RULES)
        if growth_interval is None:
            growth_interval = 1 if rule == "max_ema" else 2000
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, **kwargs)
        if not _is_pow2(self._init_scale):
            v.fail("init_scale", "a power of two for layerwise (exact boundary rescaling)", init_scale)
        self._rule = rule
        self._target_max, self._format_max, self._ema_decay, self._zero_grads, self._cap_ema = (
            validate_max_ema_rule(target_max, format_max, ema_decay, zero_grads, cap_ema_on_overflow)
        )
        if groups is not None:
            if isinstance(groups, str) or not all(isinstance(g, str) for g in groups):
                v.fail("groups", "a list of fnmatch patterns (strings) or None", groups)
            groups = list(groups)
            if not groups:
                v.fail("groups", "a non-empty list or None", groups)
        self._patterns: list[str] | None = groups
        lo = None if self._min_scale is None else 2.0 ** math.ceil(math.log2(self._min_scale))
        hi = None if self._max_scale is None else 2.0 ** math.floor(math.log2(self._max_scale))
        if lo is not None and hi is not None and lo > hi:
            v.fail("max_scale", f"a bound leaving a power of two in [min_scale={self._min_scale:g}, max_scale]",
                   self._max_scale)
        self._lo_pow2, self._hi_pow2 = lo, hi
        # Group structure (host side).
        self._group_names: list[str] = ["all"]
        self._param_group: dict[int, int] = {}
        self._handles: list[Any] = []
        self._generation = 0
        self._trace: _Trace | None = None
        self._out_group = 0
        self._called: set[int] = set()
        self._scales: torch.Tensor | None = None

    # ------------------------------------------------------------------ groups
    @property
    def num_groups(self) -> int:
        return len(self._group_names)

    @property
    def group_names(self) -> list[str]:
        return list(self._group_names)

    def _resolve_groups(self, model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
        if self._patterns is None:
            found: list[tuple[str, list[torch.nn.Module]]] = []

            def visit(prefix: str, parent: torch.nn.Module) -> None:
                for n, m in parent.named_children():
                    name = f"{prefix}{n}"
                    if not any(p.requires_grad for p in m.parameters()):
                        continue
                    if isinstance(m, _CONTAINERS):  # never called itself: its members are
                        visit(name + ".", m)
                    else:
                        found.append((name, [m]))

            visit("", model)
            return found
        out: list[tuple[str, list[torch.nn.Module]]] = [(p, []) for p in self._patterns]
        taken: list[str] = []
        for name, mod in model.named_modules():
            if name == "" or any(name.startswith(t + ".") for t in taken):
                continue
            for k, pat in enumerate(self._patterns):
                if fnmatch.fnmatchcase(name, pat):
                    out[k][1].append(mod)
                    taken.append(name)
                    break
        for pat, mods in out:
            if not mods:
                raise ValueError(f"groups pattern {pat!r} matches no module of {type(model).__name__}")
        return out

    def attach(self, model: torch.nn.Module) -> "LayerwiseStrategy":
        """Split ``model`` into groups and install the boundary hooks (replacing earlier ones).

        Raises ``ValueError`` if a trainable parameter belongs to no group."""
        self.detach()
        if not self._enabled:
            return self
        resolved = self._resolve_groups(model)
        if not resolved:  # a leaf model: one group, no boundary
            resolved = [(type(model).__name__, [])]
            param_group = {id(p): 0 for p in model.parameters()}
        else:
            param_group = {}
            for gi, (_, mods) in enumerate(resolved):
                for m in mods:
                    for p in m.parameters():
                        param_group.setdefault(id(p), gi)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in param_group]
        if missing:
            raise ValueError(f"layerwise: parameters {missing} belong to no group; "
                             "pass groups=[...] patterns that cover every trainable parameter")
        old_out = self._scale
        self._group_names = [n for n, _ in resolved]
        self._param_group = param_group
        self._out_group = len(resolved) - 1
        self._generation += 1
        handles = [model.register_forward_pre_hook(self._start_trace),
                   model.register_forward_hook(self._end_trace)]
        for gi, (_, mods) in enumerate(resolved):
            for m in mods:
                handles.append(m.register_forward_hook(self._make_group_hook(gi)))
        self._handles = handles
        if old_out is not None:
            self._init_extra_state(old_out.device, fill=old_out)
        return self

    def detach(self) -> None:
        """Remove every hook; back to one group at the current loss-side scale."""
        for h in self._handles:
            h.remove()
        was_grouped = bool(self._handles) or self.num_groups > 1
        self._handles = []
        self._generation += 1
        self._trace = None
        self._called = set()
        if was_grouped:
            self._group_names = ["all"]
            self._param_group = {}
            self._out_group = 0
            if self._scale is not None:
                self._init_extra_state(self._scale.device, fill=self._scale)

    # ------------------------------------------------------------------ forward / backward hooks
    def _start_trace(self, module: torch.nn.Module, args: Any) -> None:
        self._trace = _Trace(self._generation)

    def _end_trace(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        trace = self._trace
        if trace is not None and trace.calls:
            trace.out_group = trace.calls[-1]
            self._out_group = trace.out_group
            if self._scales is not None and self._scale is not None:
                self._scale.copy_(self._scales[self._out_group])
                self._growth_tracker.copy_(self._trackers[self._out_group])  # type: ignore[union-attr]
        self._trace = None

    def _make_group_hook(self, gi: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if self._trace is None:
                self._trace = _Trace(self._generation)
            trace = self._trace
            i = len(trace.calls)
            trace.calls.append(gi)
            self._called.add(gi)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_boundary(trace, i))
        return hook

    def _make_boundary(self, trace: _Trace, i: int):
        def boundary(grad: torch.Tensor) -> torch.Tensor | None:
            if trace.generation != self._generation or self._scales is None:
                return None
            a = trace.calls[i]
            if i + 1 < len(trace.calls):
                b = trace.calls[i + 1]
            else:
                b = trace.out_group if trace.out_group is not None else self._out_group
            if a == b:
                return None
            bad = (~torch.isfinite(grad)).any().float()
            self._contaminated[a] = torch.maximum(self._contaminated[a], bad)
            self._emitted[b] = torch.maximum(self._emitted[b], bad)
            ratio = self._scales[a] / self._scales[b]
            if grad.dtype.itemsize < 4:  # fp16/bf16/fp8: the ratio may not fit the format
                return (grad.float() * ratio).to(grad.dtype)
            return grad * ratio.to(grad.dtype)
        return boundary

    # ------------------------------------------------------------------ state
    def _init_extra_state(self, device: torch.device, fill: torch.Tensor | None = None) -> None:
        G = self.num_groups
        f = dict(dtype=torch.float32, device=device)
        i = dict(dtype=torch.int32, device=device)
        start = self._scale if fill is None else fill
        assert start is not None
        self._scales = round_down_pow2(start.detach().reshape(()).to(**f).expand(G).clone())
        self._trackers = self._growth_tracker.detach().reshape(()).expand(G).clone() \
            if self._growth_tracker is not None else torch.zeros(G, **i)
        self._ema = torch.zeros(G, **f)
        self._ema_steps = torch.zeros(G, **i)
        self._candidate = torch.full((G,), math.nan, **f)
        self._hysteresis = torch.ones(G, **i)
        self._contaminated = torch.zeros(G, **f)
        self._emitted = torch.zeros(G, **f)
        self._origin = torch.zeros(G, **f)
        self._group_stats = GradStats.empty(G, device)
        self._sync_out()

    def _sync_out(self) -> None:
        assert self._scales is not None and self._scale is not None and self._growth_tracker is not None
        k = min(self._out_group, self.num_groups - 1)
        self._scale.copy_(self._scales[k])
        self._growth_tracker.copy_(self._trackers[k])

    def _output_scale(self) -> torch.Tensor:
        assert self._scales is not None
        return self._scales[min(self._out_group, self.num_groups - 1)]

    def _group_index(self, params: list[torch.Tensor]) -> list[int] | None:
        if not self._param_group:
            return None
        try:
            return [self._param_group[id(p)] for p in params]
        except KeyError:
            raise ValueError("layerwise: the optimizer holds a parameter outside the attached model") from None

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse gradients whose scale is unknown: a group whose parameters received gradients
        but whose modules were never called (with grad enabled) since the last update — e.g. a
        pattern naming a ModuleList, or parameters used outside their module. Host-side check
        (``p.grad is None`` and Python sets), no tensor read."""
        if self._handles and self.num_groups > 1:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    gi = self._param_group.get(id(p))
                    if p.grad is not None and gi is not None and gi not in self._called:
                        raise RuntimeError(
                            f"layerwise: group {self._group_names[gi]!r} has gradients but none of its "
                            "modules was called in forward since the last update, so their scale is "
                            "unknown; choose groups (patterns) of modules that are called")
        super()._unscale_grads_(optimizer)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        self._called = set()

    def _inv_scales(self) -> torch.Tensor:
        assert self._scales is not None
        return self._scales.double().reciprocal().float()

    def _after_manual_scale(self) -> None:
        assert self._scales is not None and self._scale is not None
        self._scale.copy_(round_down_pow2(self._scale))
        self._scales.copy_(self._scale.expand_as(self._scales))

    # ------------------------------------------------------------------ the rule
    def _update_scale(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert self._scales is not None and stats is not None
        args = (
            self._scales, self._trackers, self._ema, self._ema_steps, self._hysteresis,
            self._candidate, self._origin,
            found_inf, stats.found_inf, stats.absmax, stats.numel, self._emitted, self._contaminated,
            self._rule, self._target_max, self._ema_decay, self._growth_factor, self._backoff_factor,
            self._growth_interval, self._zero_grads == "grow", self._lo_pow2, self._hi_pow2,
        )
        kernels.dispatch("layerwise_update_", layerwise_update_, *args, self._cap_ema)
        self._group_stats = stats
        self._contaminated.zero_()
        self._emitted.zero_()
        self._sync_out()

    # ------------------------------------------------------------------ checkpoints, telemetry
    def _extra_state_dict(self) -> dict[str, Any]:
        assert self._scales is not None
        return {
            "group_names": list(self._group_names),
            "rule": self._rule,
            "scales": self._scales.tolist(),
            "trackers": self._trackers.tolist(),
            "ema": self._ema.tolist(),
            "ema_steps": self._ema_steps.tolist(),
            "hysteresis": self._hysteresis.tolist(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        assert self._scales is not None
        if "scales" not in state:
            self._init_extra_state(self._scales.device)
            return
        names = list(state.get("group_names", []))
        if names != self._group_names:
            raise ValueError(f"layerwise state_dict has groups {names}, this strategy has "
                             f"{self._group_names}; attach(model) the same way before loading")
        dev = self._scales.device
        self._scales.copy_(torch.tensor(state["scales"], dtype=torch.float32, device=dev))
        self._trackers.copy_(torch.tensor(state["trackers"], dtype=torch.int32, device=dev))
        self._ema.copy_(torch.tensor(state["ema"], dtype=torch.float32, device=dev))
        self._ema_steps.copy_(torch.tensor(state["ema_steps"], dtype=torch.int32, device=dev))
        self._hysteresis.copy_(torch.tensor(state["hysteresis"], dtype=torch.int32, device=dev))
        self._sync_out()

    def _extra_telemetry(self) -> dict[str, torch.Tensor]:
        assert self._scales is not None
        s = self._group_stats
        numel = s.numel.clamp(min=1).double()
        return {
            "scales": self._scales.clone(),
            "group_growth_tracker": self._trackers.clone(),
            "group_ema": self._ema.clone(),
            "group_candidate": self._candidate.clone(),
            "group_absmax": s.absmax.clone(),
            "group_zero_frac": (s.zeros / numel).float(),
            "overflow_origin": self._origin.clone(),
        }
