"""The Strategy base class: ``torch.amp.GradScaler``'s state machine around one declared rule.

A strategy is used exactly like GradScaler (``torch/amp/grad_scaler.py``): ``scale(loss)``,
``backward()``, optional ``unscale_(optimizer)``, ``step(optimizer)``, ``update()``. A rule is three declarations and one function (see :class:`Strategy` for the list): its
hyper-parameters (``Params``, a validated dataclass, :mod:`strategies.params`), its device state
(``state_spec``, :mod:`strategies.state`) and ``update_``, which calls the rule's in-place update
function through :func:`strategies.kernels.dispatch`. From those the base class derives lazy
device-resident state, ``state_dict``/``load_state_dict`` (validated before anything changes),
telemetry, the statistics pass (:mod:`strategies.stats`) and its distributed reduction.

No method here reads a tensor on the host except GradScaler's own ``step()`` skip decision
(``found_inf.item()``; none with fused optimizers), :meth:`get_scale` and :meth:`state_dict`.
A rule's ``fault`` state (see :class:`Strategy`) is read in that same ``step()`` read.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from enum import Enum
from typing import Any, ClassVar, Iterable

import torch
import torch.distributed as dist

from strategies.params import ScalerParams
from strategies.state import RuleState, State, base_state, from_state_dict, telemetry_of, to_state_dict
from strategies.stats import GradStats, grads_by_device, unscale_and_check, unscale_and_stats


class ScaleFloorError(ValueError):
    """A rule's fault (e.g. an overflow with the scale already at ``min_scale`` and
    ``on_min_scale="raise"``) ended training; the message is one line naming the step."""


FAULT_STATE = State("fault", torch.int64, 0, low=0)


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}, "stats": None}


class Strategy:
    """Base class of every scaling strategy; a drop-in replacement for ``torch.amp.GradScaler``.

    Constructor: ``Strategy(device=None, init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=2000, enabled=True, *, min_scale, max_scale, track_stats, distributed,
    <the rule's own>)`` — the fields of ``Params`` (:class:`strategies.params.ScalerParams` and
    the rule's additions), validated at construction with one-line ``ValueError``s.

    A rule declares (class attributes):

    * ``Params`` — its hyper-parameter dataclass (subclass of ``ScalerParams``);
    * ``state_spec`` — its device state beyond the base's ``scale``, ``growth_tracker``,
      ``skipped_steps`` and ``found_inf`` (a tuple of :class:`strategies.state.State`; a
      ``State(..., when=pred)`` exists only where ``pred(params)``);
    * ``needs_stats`` — True when ``update_`` reads the gradient statistics (then they are
      gathered even with ``track_stats=False``; a rule that reads them without declaring it gets
      ``stats=None`` there and fails the contract tests);
    * ``per_group`` — one scale per layer group (``scale``/``growth_tracker`` of shape ``[G]``);
      ``pow2_scales`` — a manual ``update(new_scale)`` is rounded down to a power of two.

    and implements the hooks, of which only the first is required:

    * ``update_(found_inf, stats)`` — the rule, in place on ``self.state`` (no host sync);
    * ``on_unscale(optimizer)`` — after an optimizer's gradients were unscaled (probes);
    * ``attach(model)`` / ``detach()`` — per-layer rules install / remove their hooks;
    * ``set_reference(closure, params)`` — rules that probe an fp32 reference gradient;
    * ``group_index(params)``, ``num_groups``, ``group_names``, ``output_group`` — per-group rules.

    **Faults** (a rule that must end training, e.g. ``on_min_scale="raise"``): the rule declares
    :data:`FAULT_STATE` (``State("fault", torch.int64, 0)``) and its update function writes into
    it, on the device, the 1-based number of the update at which the fault happened (0: none;
    the first fault is kept). Nothing extra is read: :meth:`step` reads ``fault`` together with
    ``found_inf`` in its one host read (one stacked tensor) and raises :class:`ScaleFloorError`
    (one line, naming the step) before the optimizer steps — i.e. at the first ``step()`` after
    the faulty ``update()``. Fused optimizers (``_step_supports_amp_scaling``) have no host read
    in ``step()``: there the fault is caught at the logging read — ``telemetry()["fault"]`` is
    non-zero and :meth:`get_scale` raises :class:`ScaleFloorError` (:meth:`state_dict` does not:
    a checkpoint of the faulty state can still be written, and keeps ``fault``).
    """

    name: ClassVar[str] = "base"
    Params: ClassVar[type[ScalerParams]] = ScalerParams
    state_spec: ClassVar[tuple[State, ...]] = ()
    needs_stats: ClassVar[bool] = False
    per_group: ClassVar[bool] = False
    pow2_scales: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.params = self.Params(*args, **kwargs)
        self._device = None if self.params.device is None else torch.device(self.params.device)
        self.state: RuleState | None = None
        self.output_group = 0
        self.updates = 0  # update() calls so far (host counter, saved in state_dict)
        self._pending: dict[str, Any] = {}
        self._last_stats: GradStats | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

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

    def group_index(self, params: list[torch.Tensor]) -> list[int] | None:
        return None

    @property
    def num_groups(self) -> int:
        return 1

    @property
    def group_names(self) -> list[str]:
        return ["all"]

    # ------------------------------------------------------------------ state
    def _specs(self) -> tuple[State, ...]:
        return base_state(self.per_group) + tuple(s for s in self.state_spec if s.present(self.params))

    def _lazy_init(self, dev: torch.device) -> None:
        self.state = RuleState(self._specs(), self.params, self.num_groups, self._device or dev)
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

    def _round(self, scale: torch.Tensor) -> torch.Tensor:
        from strategies.max_ema import round_down_pow2  # the rule module imports this one

        return round_down_pow2(scale) if self.pow2_scales else scale

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

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self.state is None:
                    self._lazy_init(val.device)
                return val * self.output_scale().to(device=val.device, non_blocking=True)
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes)):
                iterable = map(apply, val)
                return type(val)(iterable) if isinstance(val, (list, tuple)) else iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _wants_stats(self) -> bool:
        return self.needs_stats or self.params.track_stats

    def _distributed_mode(self) -> str | None:
        """``"replicated"``/``"sharded"`` when statistics must be reduced across ranks, else None."""
        mode = self.params.distributed
        if mode == "off" or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        return "replicated" if mode == "auto" else mode

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale every gradient of ``optimizer`` (per device), record found_inf and statistics."""
        opt_state = self._per_optimizer_states[id(optimizer)]
        state = self._check_initialized("unscale_")
        params, grads = grads_by_device(optimizer)
        # FP32 division can be imprecise for some compile options, so (as torch) the reciprocal
        # is taken in FP64.
        inv_all = state.scale.double().reciprocal().float()
        found: dict[torch.device, torch.Tensor] = {}
        total: GradStats | None = None
        for device, gs in grads.items():
            inv = inv_all.to(device, non_blocking=True)
            if self._wants_stats():
                index = self.group_index(params[device]) if self.per_group else None
                st = unscale_and_stats(gs, inv, index, self.num_groups)
                found[device] = st.found_inf.amax()
                st = st.to(state.scale.device)
                total = st if total is None else total.combine(st)
            else:
                f = torch.zeros((), dtype=torch.float32, device=device)
                unscale_and_check(gs, inv, f)
                found[device] = f
        mode = self._distributed_mode()
        if mode is not None:
            # Every rank must join the collective, even one that holds no gradient this step.
            if total is None:
                total = GradStats.empty(self.num_groups, state.scale.device)
            total = total.all_reduce(mode)
            found = {state.scale.device: total.found_inf.amax()}
        opt_state["found_inf_per_device"] = found
        opt_state["stats"] = total

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale, in place, and record
        found_inf and the gradient statistics. Optional: :meth:`step` calls it if needed.

        Must be called at most once per optimizer per :meth:`update`, after all gradients are
        accumulated; a second call raises ``RuntimeError`` (as GradScaler). No host sync.
        """
        if not self.params.enabled:
            return
        self._check_initialized("unscale_")
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_grads_(optimizer)
        opt_state["stage"] = OptState.UNSCALED
        self.on_unscale(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and run ``optimizer.step(*args, **kwargs)``
        unless the gradients hold Inf/NaN, in which case the step is skipped and parameters and
        optimizer state stay bit-identical. Returns what ``optimizer.step`` returned (or None).

        The skip decision reads ``found_inf`` on the host (GradScaler's one sync), except for
        optimizers with ``_step_supports_amp_scaling`` (fused Adam/SGD), which receive
        ``found_inf`` as a tensor and skip on the device.
        """
        if not self.params.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._check_initialized("step")
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if opt_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        found = opt_state["found_inf_per_device"]
        if len(found) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if getattr(optimizer, "_step_supports_amp_scaling", False) and (
            "grad_scaler" not in inspect.signature(optimizer.step).parameters
        ):
            # Gradients are already unscaled: hand the fused optimizer found_inf only (it skips
            # on the device), exactly torch's path for an optimizer that was unscale_()d.
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = sum(t.to(state.scale.device, non_blocking=True) for t in found.values())  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        else:
            retval = None
            if "fault" in state.specs:  # one host read: found_inf of every device and the fault
                dev = state.fault.device
                read = torch.stack([t.to(dev, non_blocking=True).double() for t in found.values()]
                                   + [state.fault.double()]).tolist()
                self._raise_fault(int(read[-1]))
                skip = sum(read[:-1])
            else:
                skip = sum(t.item() for t in found.values())
            if not skip:
                retval = optimizer.step(*args, **kwargs)
        opt_state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Compute the next scale on the device from this iteration's found_inf and statistics.

        Call once per iteration, after :meth:`step` for every optimizer. ``new_scale`` sets the
        scale directly instead (a float, or a 1-element tensor on the strategy's device type),
        as GradScaler. No host sync.
        """
        if not self.params.enabled:
            return
        state = self._check_initialized("update")
        if new_scale is not None:
            self._set_scale(state, new_scale)
        else:
            found = [t.to(state.scale.device, non_blocking=True)
                     for st in self._per_optimizer_states.values() for t in st["found_inf_per_device"].values()]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf = found[0]
            for t in found[1:]:
                found_inf = found_inf + t
            stats: GradStats | None = None
            for st in self._per_optimizer_states.values():
                if st["stats"] is not None:
                    stats = st["stats"] if stats is None else stats.combine(st["stats"])
            self.update_(found_inf, stats)
            if self.params.min_scale is not None or self.params.max_scale is not None:
                state.scale.clamp_(min=self.params.min_scale, max=self.params.max_scale)
            skipped = found_inf > 0
            state.skipped_steps.add_(skipped.to(torch.int64))
            state.found_inf.copy_(skipped)
            if stats is not None:
                self._last_stats = stats
        self.updates += 1
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _set_scale(self, state: RuleState, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            state.scale.fill_(float(new_scale))
        else:
            reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                      "torch.FloatTensor with requires_grad=False.")
            if not isinstance(new_scale, torch.Tensor):
                raise AssertionError(reason)
            if new_scale.device.type != state.scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError(reason)
            state.scale.copy_(new_scale.reshape(()).expand_as(state.scale))
        state.scale.copy_(self._round(state.scale))

    # ------------------------------------------------------------------ queries
    def get_scale(self) -> float:
        """The current (loss-side) scale as a Python float (1.0 when disabled). Synchronises.
        Raises :class:`ScaleFloorError` if the rule recorded a fault (class docstring)."""
        if not self.params.enabled:
            return 1.0
        if self.state is not None and "fault" in self.state.specs:
            scale, fault = torch.stack([self.output_scale().double(), self.state.fault.double()]).tolist()
            self._raise_fault(int(fault))
            return float(scale)
        return float(self._output_value("scale", self.params.init_scale))

    def _raise_fault(self, step: int) -> None:
        if step:
            raise ScaleFloorError(
                f"{self.name}: step {step}: gradients overflowed with the loss scale at its floor "
                f"(min_scale={self.params.min_scale!r}, on_min_scale='raise'); stopping. Lower the "
                "learning rate, clip gradients or lower min_scale"
            )

    def is_enabled(self) -> bool:
        return self.params.enabled

    def get_growth_factor(self) -> float:
        return self.params.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.params = self.params.replace(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.params.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.params = self.params.replace(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.params.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.params = self.params.replace(growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        return int(self._output_value("growth_tracker", 0)) if self.params.enabled else 0

    def _output_value(self, key: str, default: float) -> float:
        """The loss-side group's entry ``key`` of the state, or of a loaded one not yet
        initialised. Synchronises."""
        if self.state is None:
            value = self._pending.get(key, default)
            return value[min(self.output_group, len(value) - 1)] if isinstance(value, list) else value
        return self.output_entry(getattr(self.state, key)).item()

    def telemetry(self) -> dict[str, torch.Tensor]:
        """Device tensors describing the last completed :meth:`update` (no sync; read them at
        your logging interval): ``scale`` (loss side), ``growth_tracker``, ``found_inf``,
        ``skipped_steps``, ``grad_absmax``, ``grad_norm``, ``grad_zero_frac``,
        ``grad_subnormal_frac``, every declared state tensor by name, and for per-group rules
        ``scales``, ``group_growth_tracker``, ``group_absmax``, ``group_zero_frac`` (shape
        ``[G]``). Empty before the first :meth:`scale` or when disabled."""
        return telemetry_of(self) if self.params.enabled and self.state is not None else {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The strategy's state as plain Python values (loadable with ``weights_only=True``):
        GradScaler's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) — so GradScaler can load a ``native`` state —
        plus ``strategy``, ``skipped_steps``, ``updates``, ``group_names`` and ``extra`` (the
        saved state tensors by name). Empty when disabled. Synchronises."""
        return to_state_dict(self) if self.params.enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a GradScaler state dict, for ``native``). Everything is
        validated first: a bad entry raises one ``ValueError`` naming it and leaves the strategy
        exactly as it was."""
        if not self.params.enabled:
            return
        params, updates, values = from_state_dict(self, state_dict)
        self.params, self.updates = params, updates
        if self.state is not None:
            self.state.load_(values)
        else:
            self._pending = values

    def __repr__(self) -> str:
        where = "uninitialised" if self.state is None else f"on {self.state.scale.device}"
        return f"{type(self).__name__}(name={self.name!r}, enabled={self.params.enabled}, scale={where})"
