"""The Strategy base class: ``torch.amp.GradScaler``'s state machine around one declared rule.

A strategy is used exactly like GradScaler (``torch/amp/grad_scaler.py``): ``scale(loss)``,
``backward()``, optional ``unscale_(optimizer)``, ``step(optimizer)``, ``update()``. A rule is
three declarations and one function (see :class:`Strategy` for the list): its hyper-parameters
(``Params``, a validated dataclass, :mod:`strategies.params`), its device state
(``state_spec``, :mod:`strategies.state`) and ``update_``, which runs the rule's in-place update
function (or its kernel) with :meth:`Strategy.run_update`, binding its arguments by name from the
state and params (:mod:`strategies.binding`). From those the base class derives lazy
device-resident state, ``state_dict``/``load_state_dict`` (validated before anything changes),
telemetry, the statistics pass (:mod:`strategies.stats`) and its distributed reduction. This module
is the state machine (``scale``, ``unscale_``, ``step``, ``update``); GradScaler's accessors
(``get_scale``, the getters and setters, ``state_dict``) are :mod:`strategies.gradscaler_api`'s.

No method reads a tensor on the host except GradScaler's own ``step()`` skip decision (``found_inf.item()``;
none with fused optimizers, and a rule's ``fault`` state in that read), ``get_scale()`` and ``state_dict()``.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from typing import Any, ClassVar, Iterable

import torch
from torch.amp.grad_scaler import OptState

from strategies import binding
from strategies.formats import round_down_pow2
from strategies.gradscaler_api import GradScalerAccessors
from strategies.params import ScalerParams, bind_arguments, sign_init, signature
from strategies.state import RuleState, ScaleFloorError, State, base_state, raise_fault, record_step_, telemetry_of
from strategies.agreement import check_ranks_agree
from strategies.gather import gather
from strategies.sharding import distributed_mode
from strategies.schedule import pass_options, run_rule
from strategies.stats import GradStats

__all__ = ["Strategy"]


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}, "stats": None}


class Strategy(GradScalerAccessors, torch.amp.GradScaler):
    """Base class of every scaling strategy; a drop-in replacement for ``torch.amp.GradScaler``.

    It *subclasses* GradScaler (rather than only mimicking its methods) so that frameworks'
    ``isinstance(scaler, torch.amp.GradScaler)`` checks pass and the private members they use
    exist (every attribute GradScaler's ``__init__`` sets and ``_lazy_init_scale_growth_tracker``:
    :mod:`strategies.gradscaler_api`; ``_check_inf_per_device``, ``_found_inf_per_device`` and
    ``_unscale_grads_`` are torch's own). Every public method is overridden; GradScaler's
    ``__init__`` is not called (the state lives in ``self.state``).

    Constructor: ``Strategy(device=None, init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=2000, enabled=True, *, min_scale, max_scale, track_stats, distributed,
    <the rule's own>)`` — the fields of ``Params`` (:class:`strategies.params.ScalerParams` and
    the rule's additions), validated at construction with one-line ``ValueError``s. Each
    subclass's ``__init__`` carries this as its real ``__signature__`` (derived from its ``Params``
    by :func:`strategies.params.signature` when the class is defined; what ``inspect.signature``,
    ``help()`` and IDEs show), and arguments are bound against it: more than GradScaler's six
    positional ones, or an unknown keyword, is a ``TypeError`` naming the strategy.

    A rule declares (class attributes):

    * ``Params`` — its hyper-parameter dataclass (subclass of ``ScalerParams``);
    * ``state_spec`` — its device state beyond the base's ``scale``, ``growth_tracker``,
      ``skipped_steps`` and ``found_inf`` (a tuple of :class:`strategies.state.State`; a
      ``State(..., when=pred)`` exists only where ``pred(params)``);
    * ``needs_stats`` — True when ``update_`` reads the gradient statistics (then they are
      gathered even with ``track_stats=False``; a rule that reads them without declaring it gets
      ``stats=None`` there and fails the contract tests);
    * ``per_group`` — one scale per layer group (``scale``/``growth_tracker`` of shape ``[G]``);
      ``pow2_scales`` — a manual ``update(new_scale)`` is rounded down to a power of two;
      ``reads_scaled`` — its ``on_unscale`` also takes still-scaled gradients (a fused optimizer's).

    and implements the hooks, of which only the first is required:

    * ``update_(found_inf, stats)`` — the rule, in place on ``self.state`` (no host sync);
    * ``on_unscale(optimizer)`` — after an optimizer's gradients were unscaled or read (probes);
    * ``attach(model)`` / ``detach()`` — per-layer rules install / remove their hooks;
    * ``before_scale(outputs)`` / ``after_scale(scaled)`` — around :meth:`scale`'s multiplication
      (an attached rule reads the loss's graph, then marks what it returns);
    * ``guard(what)`` — raise where :meth:`get_scale` or :meth:`unscale_` would be wrong now;
    * ``set_reference(closure, params)`` — rules that probe an fp32 reference gradient;
    * ``group_index(params)``, ``num_groups``, ``group_names``, ``output_group`` — per-group rules.

    **Faults** (a rule that must end training, e.g. ``on_min_scale="raise"``): the rule declares
    :data:`strategies.state.FAULT_STATE` and writes the update number of the fault into it on the device;
    :meth:`step` reads it with ``found_inf`` in its one host read and raises
    :class:`ScaleFloorError` before the optimizer steps. Fused optimizers have no host read in
    ``step()``: there ``telemetry()["fault"]`` is non-zero and :meth:`get_scale` raises
    (:meth:`state_dict` does not, so a checkpoint of the faulty state can still be written).
    """

    name: ClassVar[str] = "base"
    Params: ClassVar[type[ScalerParams]] = ScalerParams
    state_spec: ClassVar[tuple[State, ...]] = ()
    needs_stats: ClassVar[bool] = False
    per_group: ClassVar[bool] = False
    pow2_scales: ClassVar[bool] = False
    reads_scaled: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give the subclass an ``__init__`` whose ``__signature__`` is its ``Params``'."""
        super().__init_subclass__(**kwargs)
        sign_init(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # GradScaler.__init__ deliberately not called
        bind_arguments(self, args, kwargs)
        self.params = self.Params(*args, **kwargs)
        if self.params.device == "cuda" and self.params.enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.")
            self.params = self.params.replace(enabled=False)  # as GradScaler
        self._state_device = None if self.params.device is None else torch.device(self.params.device)
        self._init_values: dict[str, float | int] = {"scale": self.params.init_scale, "growth_tracker": 0}
        self.state: RuleState | None = None
        self.output_group = 0
        self.updates = 0  # update() calls so far (host counter, saved in state_dict)
        self._pending: dict[str, Any] = {}
        self._last_stats: GradStats | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        self._bound: dict[str, tuple[Any, ...]] = {}  # op -> run_update's cached binding.bind(...)
        self._ranks_agree = False  # checked at the first gather under a process group (strategies.agreement)

    # ------------------------------------------------------------------ hooks (see class docstring)
    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        raise NotImplementedError

    def on_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def attach(self, model: torch.nn.Module) -> "Strategy":
        return self

    def detach(self) -> None:
        pass

    def set_reference(self, closure: Any, params: Iterable[torch.Tensor] | None = None) -> None:
        pass

    def before_scale(self, outputs: Any) -> None:
        """Called by :meth:`scale` (enabled) before it multiplies ``outputs``."""

    def after_scale(self, scaled: Any) -> Any:
        """What :meth:`scale` returns for the multiplied ``scaled`` (itself by default)."""
        return scaled

    def guard(self, what: str) -> None:
        """Called first by :meth:`get_scale` and :meth:`unscale_` (``what`` names the call): a rule
        raises ``RuntimeError`` where the call would be wrong in its current state."""

    @property
    def hook_seconds(self) -> float:
        """Host seconds the layer-boundary hooks of an attached strategy have run so far (0.0 for
        the others): their cost per backward, which :meth:`scale` to :meth:`update` do not see."""
        return 0.0 if getattr(self, "_handle", None) is None else self._handle.seconds

    def group_index(self, params: list[torch.Tensor]) -> list[int] | None:
        return None

    @property
    def num_groups(self) -> int:
        return 1

    @property
    def group_names(self) -> list[str]:
        return ["all"]

    def run_update(self, op: str, twin: Any, **inputs: Any) -> None:
        """Run ``torch.ops.scalelab.<op>`` (or its Python ``twin``) with its arguments bound by
        name (:mod:`strategies.binding`): each parameter of the twin's signature, in its order,
        is the state tensor of that name, else the ``Params`` field, else the passed input (an
        input takes the place of a state or field of its name). The bound list is cached per op
        while ``self.state``, ``self.params`` and the input names are the same (state tensors
        are updated in place, params replaced whole), so a step only fills in the inputs."""
        binding.run(self._bound, op, twin, self.state, self.params, self.state_spec, inputs)

    # ------------------------------------------------------------------ state
    def _specs(self) -> tuple[State, ...]:
        return base_state(self.per_group) + tuple(s for s in self.state_spec if s.present(self.params))

    def _lazy_init(self, dev: torch.device) -> None:
        self.state = RuleState(self._specs(), self.params, self.num_groups, self._state_device or dev)
        if self._pending:
            self.state.load_(self._pending)
            self._pending = {}

    def regroup_(self) -> None:
        """Re-create per-group state after the groups changed (per-group rules call it from
        ``attach``/``detach``): every group starts at the current output scale and tracker;
        state that is not per group is kept."""
        old = self.state
        if old is None:
            return
        scale, tracker = self.output_entry(old.scale).clone(), self.output_entry(old.growth_tracker).clone()
        self.output_group = 0
        self._lazy_init(old.scale.device)
        for name, spec in self.state.specs.items():
            if not spec.per_group:
                getattr(self.state, name).copy_(getattr(old, name))
        self.state.scale.copy_(self._round(scale).expand_as(self.state.scale))
        self.state.growth_tracker.copy_(tracker.expand_as(self.state.growth_tracker))
        self._last_stats = None
        self._ranks_agree = False

    def _round(self, scale: torch.Tensor) -> torch.Tensor:
        return round_down_pow2(scale) if self.pow2_scales else scale

    def _bounded(self, scale: torch.Tensor) -> torch.Tensor:
        """A scale set by hand (``update(new_scale)``) kept within ``[min_scale, max_scale]``, as
        every update keeps it (on the device, no sync): clamped, then rounded down to a power of
        two for ``pow2_scales`` rules — doubled if that fell below ``min_scale`` (a rule with
        power-of-two scales validates that one lies within the bounds)."""
        lo, hi = self.params.min_scale, self.params.max_scale
        clamped = scale.clamp(min=lo, max=hi) if lo is not None or hi is not None else scale
        rounded = self._round(clamped)
        return torch.where(rounded < lo, rounded * 2, rounded) if lo is not None else rounded

    def _check_initialized(self, funcname: str) -> RuleState:
        if self.state is None:
            raise AssertionError(
                f"Attempted {funcname} but the scale is not initialised. This may indicate your "
                "script did not use strategy.scale(loss or outputs) earlier in the iteration."
            )
        return self.state

    def output_entry(self, t: torch.Tensor) -> torch.Tensor:
        """The loss-side group's entry of a state tensor (``t`` itself for global rules)."""
        return t[min(self.output_group, t.numel() - 1)] if t.dim() else t

    def output_scale(self) -> torch.Tensor:
        """The scale :meth:`scale` multiplies by: the loss-side group's for per-group rules."""
        return self.output_entry(self._check_initialized("output_scale").scale)

    # ------------------------------------------------------------------ the API
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or an iterable of tensors, nested) by the current scale."""
        if not self.params.enabled:
            return outputs
        self.before_scale(outputs)

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self.state is None:
                    self._lazy_init(val.device)
                scaled = val * self.output_scale().to(device=val.device, non_blocking=True)
                return scaled.type(val.dtype) if self.params.distributed == "sharded" else scaled  # as ShardedGradScaler
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes)):
                iterable = map(apply, val)
                return type(val)(iterable) if isinstance(val, (list, tuple)) else iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return self.after_scale(apply(outputs))

    def _distributed_mode(self) -> str | None:
        """The ``distributed`` setting when a process group is up, else None (:mod:`strategies.sharding`)."""
        return distributed_mode(self.params.distributed)

    def _gather(self, optimizer: torch.optim.Optimizer, unscale: bool = True) -> None:
        """Unscale ``optimizer``'s gradients (or only read them, ``unscale=False``) and record found_inf
        and the statistics (:func:`strategies.gather.gather`); first, under a process group, check once
        that every rank holds the same scaler state (:func:`strategies.agreement.check_ranks_agree`)."""
        state = self._check_initialized("unscale_")
        mode = self._distributed_mode()
        if mode is not None and not self._ranks_agree:
            self._ranks_agree = check_ranks_agree(self)
        found, stats = gather(optimizer, state.scale, unscale=unscale, mode=mode, who=self.name,
                              **pass_options(self),
                              group_index=self.group_index if self.per_group else None, num_groups=self.num_groups,
                              allow_fp16=self.params.distributed == "sharded")
        self._per_optimizer_states[id(optimizer)].update(found_inf_per_device=found, stats=stats)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale, in place, and record
        found_inf and the gradient statistics. Optional: :meth:`step` calls it if needed.

        Must be called at most once per optimizer per :meth:`update`, after all gradients are
        accumulated; a second call raises ``RuntimeError`` (as GradScaler). No host sync.
        """
        self.guard("unscale_()")
        if not self.params.enabled:
            return
        self._check_initialized("unscale_")
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._gather(optimizer)
        opt_state["stage"] = OptState.UNSCALED
        self.on_unscale(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and run ``optimizer.step(*args, **kwargs)``
        unless the gradients hold Inf/NaN, in which case the step is skipped and parameters and
        optimizer state stay bit-identical. Returns what ``optimizer.step`` returned (or None).
        The skip decision reads ``found_inf`` on the host (GradScaler's one sync), except for
        optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD), handled as
        GradScaler does: one whose ``step`` takes ``grad_scaler`` receives the strategy; others
        receive ``found_inf`` (they skip on the device) and, when :meth:`unscale_` was not called,
        ``grad_scale`` — their fused kernel unscales, the strategy (probes: ``reads_scaled``) only
        reads the gradients (no write; fp16 accepted, as GradScaler); per-group rules unscale."""
        if not self.params.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._check_initialized("step")
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn("GradScaler is going to stop passing itself as a keyword argument to the passed "
                          "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                          "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                          FutureWarning, stacklevel=2)
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            opt_state["stage"] = OptState.STEPPED
            return retval
        ready = opt_state["stage"] is OptState.READY
        reads = self.reads_scaled or type(self).on_unscale is Strategy.on_unscale
        if ready and fused and not self.per_group and reads:
            self._gather(optimizer, unscale=False)
            self.on_unscale(optimizer)  # the stage stays READY: the gradients it reads are scaled
        elif ready:
            self.unscale_(optimizer)
            ready = False
        found = opt_state["found_inf_per_device"]
        if len(found) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if fused:
            optimizer.grad_scale = (state.scale * getattr(optimizer, "grad_scale", 1) if ready  # type: ignore[attr-defined]
                                    else getattr(optimizer, "grad_scale", None))
            optimizer.found_inf = sum(t.to(state.scale.device, non_blocking=True) for t in found.values())  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        else:
            retval = None
            if "fault" in state.specs:  # the one host read: found_inf per device and the fault
                read = torch.stack([t.to(state.scale.device, non_blocking=True).double() for t in found.values()]
                                   + [state.fault.double()]).tolist()
                raise_fault(self, int(read.pop()))
            else:  # GradScaler's own read
                read = [t.item() for t in found.values()]
            if not sum(read):
                retval = optimizer.step(*args, **kwargs)
        opt_state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Compute the next scale on the device from this iteration's found_inf and statistics.

        Call once per iteration, after :meth:`step` for every optimizer. ``new_scale`` sets the
        scale directly instead (a float, or a 1-element tensor on the strategy's device type),
        as GradScaler, clamped into ``[min_scale, max_scale]`` like every update. No host sync.
        """
        if not self.params.enabled:
            return
        state = self._check_initialized("update")
        if new_scale is not None:
            state.set_scale_(new_scale)
            state.scale.copy_(self._bounded(state.scale))
        else:
            dev = state.scale.device
            found = [t if t.device == dev else t.to(dev, non_blocking=True)
                     for st in self._per_optimizer_states.values() for t in st["found_inf_per_device"].values()]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf = sum(found[1:], found[0])
            stats: GradStats | None = None
            for st in self._per_optimizer_states.values():
                if st["stats"] is not None:
                    stats = st["stats"] if stats is None else stats.combine(st["stats"])
            if self._distributed_mode() is not None:  # rank-local observations the rule declared with reduce=...
                state.all_reduce_()
            run_rule(self, found_inf, stats)  # update_, or hold_ between statistic steps (stats_every)
            self.run_update("record_step_", record_step_, found_state=state.found_inf, found_inf=found_inf)
            if stats is not None:
                self._last_stats = stats
        self.updates += 1
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # ------------------------------------------------------------------ telemetry
    def telemetry(self) -> dict[str, torch.Tensor]:
        """Device tensors describing the last completed :meth:`update` (no sync; read them at
        your logging interval): ``scale`` (loss side), ``growth_tracker``, ``found_inf``,
        ``skipped_steps``, ``grad_absmax``, ``grad_norm``, ``grad_zero_frac``,
        ``grad_subnormal_frac``, every declared state tensor by name, and for per-group rules
        ``scales``, ``group_growth_tracker``, ``group_absmax``, ``group_zero_frac`` (shape
        ``[G]``). Empty before the first :meth:`scale` or when disabled."""
        return telemetry_of(self) if self.params.enabled and self.state is not None else {}


Strategy.__init__.__signature__ = signature(ScalerParams)  # type: ignore[attr-defined]
