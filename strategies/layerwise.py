"""``layerwise``: one power-of-two scale per layer group, exact rescaling at group boundaries.

Rule (seed 003, section 3.3 "层级化动态缩放 (Layer-wise Scaling)": layers near the input usually
have smaller gradients than layers near the output, so each layer group l keeps its own scale
S_l). Groups are indexed 0..G-1; by default the model's layers
(:func:`strategies.boundaries.layers`: its declared ``boundaries``, else each top-level child
module that owns parameters, looking into ``ModuleList``/``ModuleDict``), or the modules
matched by ``groups`` (fnmatch patterns over qualified module names; one group per pattern,
outermost match, first pattern wins). Every trainable parameter must belong to a
group, and a group whose parameters receive gradients must have been called in forward
(:meth:`unscale_` raises otherwise: its gradients' scale would be unknown).

Mechanics (all scales are powers of two, so every rescaling below is exact unless the result
leaves the format's range — which is precisely what scaling is about):

* :meth:`attach` registers the ``"rescale"`` stage of the model's layer boundaries
  (:mod:`strategies.boundaries`) on the group modules: every forward pass records the sequence
  of group *calls*, and in backward the transform of call i (group a) receives the gradient of everything downstream of it, which is at
  the scale of the next call's group b (the loss side), and multiplies it by ``S_a / S_b`` (in
  float32, cast back to the gradient's dtype). Hence a group's parameter gradients carry S_l,
  and the glue ops between two group calls work at the scale of the later group. Because transforms
  are per call, a module called several times (shared weights, recurrences) is handled: each
  call converts to its successor's scale.
* :meth:`scale` multiplies the loss by the scale of the group called last in the latest forward
  (the group nearest the loss); :meth:`get_scale` returns that scale.
* :meth:`unscale_` divides each group's parameter gradients by its own S_l.
* The group calls must form a chain: what consumes call i's output lies between it and call
  i+1 (sequential models, blocks with internal residuals). The first forward pass after
  :meth:`attach` checks this on the autograd graph and refuses a skip connection across a group
  boundary with one error; groups that share parameters (tied weights) are merged into one at
  :meth:`attach`, with one warning (:mod:`strategies.layer_groups`). Not supported: activation
  checkpointing inside groups, computing the loss from a non-final group's output.
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

import math
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from strategies import adaloss, kernels, layer_groups
from strategies import validation as v
from strategies.base import Strategy
from strategies.boundaries import Boundaries, Trace
from strategies.max_ema import MaxEmaRule, max_ema_update_, round_down_pow2
from strategies.native import native_update_
from strategies.params import ScalerParams, hp
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

RULES = ("max_ema", "backoff_growth", "adaloss")
"""Per-group rules. ``adaloss`` (strategies/adaloss.py) runs in Python: it has no kernel yet."""


def overflow_origin(found_inf: torch.Tensor, group_found_inf: torch.Tensor, emitted: torch.Tensor,
                    contaminated: torch.Tensor) -> torch.Tensor:
    """The groups an overflow is attributed to on a skipped step (bool [G]): own gradients or an
    emitted gradient non-finite, and not contaminated from above; every group if none qualifies."""
    skip = found_inf != 0
    blamed = ((group_found_inf != 0) | (emitted > 0)) & ~(contaminated > 0) & skip
    return blamed | (skip & ~blamed.any())


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
    skip = found_inf != 0
    blamed = overflow_origin(found_inf, group_found_inf, emitted, contaminated)
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


def _is_pow2(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


@dataclass
class LayerwiseParams(MaxEmaRule, ScalerParams):
    init_scale: float = hp(2.0**15, v.finite_positive, "seed 003 §3.1",
                           "every group's initial scale; rounded down to a power of two (one warning)")
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
        if self.growth_interval is None:
            self.growth_interval = 2000 if self.rule == "backoff_growth" else 1
        if not _is_pow2(self.init_scale):  # any positive finite scale, as GradScaler takes (3.0, 1e38)
            rounded = 2.0 ** math.floor(math.log2(self.init_scale))
            warnings.warn(f"layerwise: init_scale {self.init_scale!r} rounded down to the power of two {rounded!r} "
                          "(group scales are powers of two so that boundary rescaling is exact)", stacklevel=5)
            self.init_scale = rounded
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
        self._group_names: list[str] = ["all"]
        self._param_group: dict[int, int] = {}
        self._weight_stats: tuple[Any, adaloss.WeightStats] | None = None
        self._module_group: dict[int, int] = {}
        self._weights: list[list[torch.Tensor]] = [[]]  # per group, for rule adaloss
        self._handle: Any = None
        self._generation = 0
        self._called: set[int] = set()
        self._called_at = -1
        self._chain_checked = True

    # ------------------------------------------------------------------ groups
    @property
    def num_groups(self) -> int:
        return len(self._group_names)

    @property
    def group_names(self) -> list[str]:
        return list(self._group_names)

    def attach(self, model: torch.nn.Module) -> "LayerwiseStrategy":
        """Split ``model`` into groups and register the boundary rescaling (replacing an earlier
        attach). Raises ``ValueError`` if a trainable parameter belongs to no group."""
        self.detach()
        if not self.params.enabled:
            return self
        resolved = layer_groups.resolve(model, self.params.groups)
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
        self._group_names = [n for n, _ in resolved]
        self._param_group = param_group
        self._module_group = {id(m): gi for gi, (_, mods) in enumerate(resolved) for m in mods}
        self._weights = [list({id(p): p for m in mods for p in m.parameters()}.values()) for _, mods in resolved]
        self._generation += 1
        self._chain_checked = len(resolved) < 2
        self.regroup_()
        self.output_group = len(resolved) - 1
        modules = [m for _, mods in resolved for m in mods]
        if modules:
            gen = self._generation
            self._handle = Boundaries.of(model).register(
                "rescale", modules,
                on_grad=lambda trace, i, g: self._rescale(gen, trace, i, g),
                on_call=lambda trace, i: self._on_call(gen, trace, i),
                on_end=lambda trace: self._on_end(gen, trace),
            )
        return self

    def detach(self) -> None:
        """Remove the boundary transforms; back to one group at the current loss-side scale."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._generation += 1
        self._called = set()
        if self.num_groups > 1 or self._param_group:
            self._group_names = ["all"]
            self._param_group, self._module_group, self._weights = {}, {}, [[]]
            self.regroup_()

    # ------------------------------------------------------------------ forward / backward
    def _group_calls(self, trace: Trace) -> list[int]:
        return [self._module_group.get(id(m), -1) for m in trace.calls]

    def _on_call(self, gen: int, trace: Trace, i: int) -> None:
        if gen != self._generation:
            return
        if self._called_at != self.updates:
            self._called, self._called_at = set(), self.updates
        self._called.add(self._module_group[id(trace.calls[i])])

    def _on_end(self, gen: int, trace: Trace) -> None:
        mine = [g for g in self._group_calls(trace) if g >= 0]
        if gen == self._generation and mine:
            self.output_group = mine[-1]
            if not self._chain_checked:  # once per attach: skip connections across groups
                layer_groups.check_chain(trace, self._module_group, self._group_names)
                self._chain_checked = True

    def _rescale(self, gen: int, trace: Trace, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Gradient of call i (group a), at the scale of the next call's group b: x S_a / S_b."""
        if gen != self._generation or self.state is None:
            return None
        calls = self._group_calls(trace)
        a = calls[i]
        later = [g for g in calls[i + 1:] if g >= 0]
        b = later[0] if later else ([g for g in calls if g >= 0][-1] if trace.finished else self.output_group)
        s = self.state
        if self.params.rule == "adaloss":  # the gradient arriving at group a's output, unscaled
            adaloss.record_(s.ada_g2, s.ada_n, s.ada_gmax, a, grad, s.scale[b])
        if a == b:
            return None
        bad = (~torch.isfinite(grad)).any().float()
        s.contaminated[a] = torch.maximum(s.contaminated[a], bad)
        s.emitted[b] = torch.maximum(s.emitted[b], bad)
        ratio = s.scale[a] / s.scale[b]
        if grad.dtype.itemsize < 4:  # fp16/bf16/fp8: the ratio may not fit the format
            return (grad.float() * ratio).to(grad.dtype)
        return grad * ratio.to(grad.dtype)

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
            called = self._called if self._called_at == self.updates else set()
            for gi in sorted(set(index) - called):
                raise RuntimeError(
                    f"layerwise: group {self._group_names[gi]!r} has gradients but none of its "
                    "modules was called in forward since the last update, so their scale is "
                    "unknown; choose groups (patterns) of modules that are called")
        return index

    # ------------------------------------------------------------------ the rule
    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        p, s = self.params, self.state
        lo, hi = p.pow2_bounds
        if p.rule == "adaloss":
            key = (self._generation, s.scale.device)
            if self._weight_stats is None or self._weight_stats[0] != key:  # built once per attach
                self._weight_stats = (key, adaloss.WeightStats(self._weights, s.scale.device))
            kernels.dispatch("adaloss_step_", adaloss.adaloss_step_, s.scale, s.overflow_origin, s.ada_g2, s.ada_n,
                             s.ada_gmax, found_inf, stats.found_inf, s.emitted, s.contaminated,
                             *self._weight_stats[1](), adaloss.quantile(p.underflow_rate), p.format_min,
                             p.format_max, p.layer_cap, p.total_cap, p.backoff_factor, lo, hi)
        else:
            kernels.dispatch("layerwise_update_", layerwise_update_, s.scale, s.growth_tracker, s.ema, s.ema_steps,
                             s.hysteresis, s.candidate, s.overflow_origin, found_inf, stats.found_inf, stats.absmax,
                             stats.numel, s.emitted, s.contaminated, p.rule, p.target_max, p.ema_decay,
                             p.growth_factor, p.backoff_factor, p.growth_interval, p.zero_grads == "grow", lo, hi,
                             p.cap_ema_on_overflow)
        if self._handle is not None:  # only the boundary hooks write them
            s.contaminated.zero_()
            s.emitted.zero_()
