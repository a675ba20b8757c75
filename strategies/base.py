"""The Strategy base class: ``torch.amp.GradScaler``'s state machine with a pluggable update rule.

A strategy is used exactly like GradScaler (see ``torch/amp/grad_scaler.py``)::

    scaled = strategy.scale(loss)      # loss * S
    scaled.backward()
    strategy.unscale_(optimizer)       # optional: grads /= S in place, statistics recorded
    strategy.step(optimizer)           # unscale_ if not done; skip optimizer.step() if non-finite
    strategy.update()                  # next S, computed on the device

The base class owns everything the strategies share — lazy device-resident state, per-optimizer
stages and their errors, the single statistics pass (:mod:`strategies.stats`), the distributed
all-reduce of statistics, the optional ``[min_scale, max_scale]`` clamp, skipped-step counting,
telemetry and ``state_dict`` — and a subclass supplies only its rule in :meth:`_update_scale`
(plus, for per-group strategies, :meth:`_group_index` / :meth:`_inv_scales`).

No method here reads a tensor on the host except GradScaler's own ``step()`` skip decision
(``found_inf.item()``; none with fused optimizers), :meth:`get_scale` and :meth:`state_dict`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import defaultdict
from enum import Enum
from typing import Any, ClassVar, Iterable

import torch
import torch.distributed as dist

from strategies import validation as v
from strategies.stats import GradStats, unscale_and_check, unscale_and_stats


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}, "stats": None}


DISTRIBUTED_MODES = ("auto", "off", "replicated", "sharded")


class Strategy:
    """Base class of every scaling strategy; a drop-in replacement for ``torch.amp.GradScaler``.

    Args:
        init_scale: initial scale S_0 (finite, > 0). Default 2^16, as torch.
        growth_factor: factor > 1 by which the rule may grow S. Default 2.
        backoff_factor: factor in (0, 1) applied to S on non-finite gradients. Default 0.5.
        growth_interval: integer >= 1; how many clean steps a rule waits before growing.
        enabled: ``False`` makes every method a transparent no-op (``step`` just steps).
        min_scale, max_scale: optional bounds; after every update S is clamped into them.
            Off by default, as in torch (so ``native`` stays bit-identical to GradScaler).
        device: pin the state's device; default: the device of the first tensor given to
            :meth:`scale`.
        track_stats: gather gradient statistics (abs-max, norm, zero/subnormal counts) on every
            unscale for telemetry. Rules that need them gather them regardless. With it off, a
            rule that needs none uses torch's found-inf-only unscale.
        distributed: ``"auto"`` (all-reduce statistics when ``torch.distributed`` is
            initialised, as replicated gradients), ``"off"``, ``"replicated"`` (DDP: every rank
            holds the full gradient; MAX-reduce) or ``"sharded"`` (FSDP/ZeRO: ranks hold
            disjoint shards; MAX for found_inf/abs-max, SUM for sums and counts). Either way all
            ranks take the same skip and scale decisions.
    """

    name: ClassVar[str] = "base"
    needs_stats: ClassVar[bool] = False
    """True when :meth:`_update_scale` reads the gradient statistics every step."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        device: str | torch.device | None = None,
        track_stats: bool = True,
        distributed: str = "auto",
    ) -> None:
        self._init_scale = v.finite_positive("init_scale", init_scale)
        self._growth_factor = v.greater_than("growth_factor", growth_factor, 1.0)
        self._backoff_factor = v.open_interval("backoff_factor", backoff_factor, 0.0, 1.0)
        self._growth_interval = v.int_at_least("growth_interval", growth_interval, 1)
        self._min_scale = None if min_scale is None else v.finite_positive("min_scale", min_scale)
        self._max_scale = None if max_scale is None else v.finite_positive("max_scale", max_scale)
        if self._min_scale is not None and self._max_scale is not None and self._min_scale > self._max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got min_scale={min_scale!r} > max_scale={max_scale!r}"
            )
        self._enabled = v.boolean("enabled", enabled)
        self._track_stats = v.boolean("track_stats", track_stats)
        self._distributed = v.one_of("distributed", distributed, DISTRIBUTED_MODES)
        self._device = None if device is None else torch.device(device)
        self._init_growth_tracker = 0
        self._init_skipped = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._pending_extra: dict[str, Any] = {}
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # ------------------------------------------------------------------ subclass hooks
    def _update_scale(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        """The rule: update ``self._scale`` (and trackers) in place on the device.

        ``found_inf`` is a float32 scalar tensor, > 0 when any gradient of any optimizer was
        non-finite this step; ``stats`` the per-group statistics (None when not gathered).
        Must not read tensors on the host.
        """
        raise NotImplementedError

    def _init_extra_state(self, device: torch.device) -> None:
        """Create rule-specific device tensors (called once, at lazy initialisation)."""

    def _extra_state_dict(self) -> dict[str, Any]:
        """Rule-specific state as plain Python values (floats, ints, lists)."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`_extra_state_dict` returned; state tensors exist when called."""

    def _extra_telemetry(self) -> dict[str, torch.Tensor]:
        return {}

    @property
    def num_groups(self) -> int:
        return 1

    @property
    def group_names(self) -> list[str]:
        return ["all"]

    def _group_index(self, params: list[torch.Tensor]) -> list[int] | None:
        """Group of each parameter (None: all in group 0)."""
        return None

    def _inv_scales(self) -> torch.Tensor:
        """Inverse scale(s) by which gradients are unscaled: shape ``[]`` or ``[G]``.

        FP32 division can be imprecise for some compile options, so (as torch) the reciprocal is
        taken in FP64.
        """
        assert self._scale is not None
        return self._scale.double().reciprocal().float()

    def _output_scale(self) -> torch.Tensor:
        """The factor :meth:`scale` multiplies outputs by."""
        assert self._scale is not None
        return self._scale

    # ---------------------------------------------------------- uniform loop helpers
    def attach(self, model: torch.nn.Module) -> "Strategy":
        """Per-layer strategies install hooks here; a no-op for global ones."""
        return self

    def detach(self) -> None:
        """Remove whatever :meth:`attach` installed."""

    def set_reference(self, closure: Any, params: Iterable[torch.Tensor] | None = None) -> None:
        """Strategies that probe an fp32 reference gradient take its closure here; others ignore it."""

    # ------------------------------------------------------------------ lazy state
    def _lazy_init(self, dev: torch.device) -> None:
        dev = self._device or dev
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._skipped = torch.full((), self._init_skipped, dtype=torch.int64, device=dev)
        self._last_found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._last_stats = GradStats.empty(1, dev)
        self._last_stats.absmax.fill_(math.nan)
        self._last_stats.sumsq.fill_(math.nan)
        self._init_extra_state(dev)
        if self._pending_extra:
            self._load_extra_state(self._pending_extra)
            self._pending_extra = {}

    def _check_initialized(self, funcname: str) -> torch.Tensor:
        if self._scale is None:
            raise AssertionError(
                f"Attempted {funcname} but the scale is not initialised. This may indicate your "
                "script did not use strategy.scale(loss or outputs) earlier in the iteration."
            )
        return self._scale

    # ------------------------------------------------------------------ the API
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or an iterable of tensors, nested) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._output_scale().to(device=outputs.device, non_blocking=True)

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(val.device)
                return val * self._output_scale().to(device=val.device, non_blocking=True)
            if isinstance(val, (list, tuple)):
                return type(val)(apply(x) for x in val)
            if isinstance(val, Iterable):
                return map(apply, val)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _wants_stats(self) -> bool:
        return (
            self.needs_stats
            or self._track_stats
            or self.num_groups > 1
            or self._distributed_active()
        )

    def _distributed_active(self) -> bool:
        if self._distributed == "off":
            return False
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _all_reduce(self, stats: GradStats) -> GradStats:
        """Make every rank see the same statistics: one or two collectives, no host sync."""
        mode = "replicated" if self._distributed == "auto" else self._distributed
        g = stats.found_inf.numel()
        if mode == "replicated":
            packed = torch.cat([stats.found_inf.double(), stats.absmax.double(), stats.sumsq.double(),
                                stats.zeros.double(), stats.subnormals.double(), stats.numel.double()])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            parts = packed.split(g)
            return GradStats(parts[0].float(), parts[1].float(), parts[2].float(),
                             parts[3].long(), parts[4].long(), parts[5].long())
        peak = torch.cat([stats.found_inf, stats.absmax])
        summed = torch.cat([stats.sumsq.double(), stats.zeros.double(),
                            stats.subnormals.double(), stats.numel.double()])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        p, s = peak.split(g), summed.split(g)
        return GradStats(p[0], p[1], s[0].float(), s[1].long(), s[2].long(), s[3].long())

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale every gradient of ``optimizer`` (per device), record found_inf and statistics."""
        state = self._per_optimizer_states[id(optimizer)]
        scale = self._check_initialized("unscale_")
        params: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.dtype == torch.float16:  # as GradScaler: fp16 master grads are unsafe
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if p.grad.is_sparse:
                        if p.grad.dtype is torch.float16:
                            p.grad = p.grad.coalesce()
                        g = p.grad._values()
                    else:
                        g = p.grad
                    params[g.device].append(p)
                    grads[g.device].append(g)
        inv_all = self._inv_scales()
        found: dict[torch.device, torch.Tensor] = {}
        total: GradStats | None = None
        for device, gs in grads.items():
            inv = inv_all.to(device, non_blocking=True)
            if self._wants_stats():
                st = unscale_and_stats(gs, inv, self._group_index(params[device]), self.num_groups)
                found[device] = st.found_inf.amax()
                st = st.to(scale.device)
                total = st if total is None else total.combine(st)
            else:
                f = torch.zeros((), dtype=torch.float32, device=device)
                unscale_and_check(gs, inv, f)
                found[device] = f
        if self._distributed_active():
            # Every rank must join the collective, even one that holds no gradient this step.
            if total is None:
                total = GradStats.empty(self.num_groups, scale.device)
            total = self._all_reduce(total)
            found = {scale.device: total.found_inf.amax()}
        state["found_inf_per_device"] = found
        state["stats"] = total

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale, in place, and record
        found_inf and the gradient statistics. Optional: :meth:`step` calls it if needed.

        Must be called at most once per optimizer per :meth:`update`, after all gradients are
        accumulated; a second call raises ``RuntimeError`` (as GradScaler). No host sync.
        """
        if not self._enabled:
            return
        self._check_initialized("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_grads_(optimizer)
        state["stage"] = OptState.UNSCALED

    def _found_inf_sum(self, state: dict[str, Any], device: torch.device) -> torch.Tensor:
        return sum(t.to(device, non_blocking=True) for t in state["found_inf_per_device"].values())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and run ``optimizer.step(*args, **kwargs)``
        unless the gradients hold Inf/NaN, in which case the step is skipped and parameters and
        optimizer state stay bit-identical. Returns what ``optimizer.step`` returned (or None).

        The skip decision reads ``found_inf`` on the host (GradScaler's one sync), except for
        optimizers with ``_step_supports_amp_scaling`` (fused Adam/SGD), which receive
        ``found_inf`` as a tensor and skip on the device.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._check_initialized("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if getattr(optimizer, "_step_supports_amp_scaling", False) and (
            "grad_scaler" not in inspect.signature(optimizer.step).parameters
        ):
            # Gradients are already unscaled: hand the fused optimizer found_inf only (it skips
            # on the device), exactly torch's path for an optimizer that was unscale_()d.
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = self._found_inf_sum(state, scale.device)  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        else:
            retval = None
            if not sum(t.item() for t in state["found_inf_per_device"].values()):
                retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Compute the next scale on the device from this iteration's found_inf and statistics.

        Call once per iteration, after :meth:`step` for every optimizer. ``new_scale`` sets the
        scale directly instead (a float, or a 1-element tensor on the strategy's device type),
        as GradScaler. No host sync.
        """
        if not self._enabled:
            return
        scale = self._check_initialized("update")
        if new_scale is not None:
            if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
                scale.fill_(float(new_scale))
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if not isinstance(new_scale, torch.Tensor):
                    raise AssertionError(reason)
                if new_scale.device.type != scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                scale.copy_(new_scale.reshape(()))
            self._after_manual_scale()
        else:
            found = [
                t.to(scale.device, non_blocking=True)
                for st in self._per_optimizer_states.values()
                for t in st["found_inf_per_device"].values()
            ]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf = found[0]
            for t in found[1:]:
                found_inf = found_inf + t
            stats: GradStats | None = None
            for st in self._per_optimizer_states.values():
                if st["stats"] is not None:
                    stats = st["stats"] if stats is None else stats.combine(st["stats"])
            self._update_scale(found_inf, stats)
            self._clamp()
            skipped = found_inf > 0
            self._skipped.add_(skipped.to(torch.int64))
            self._last_found_inf.copy_(skipped)
            if stats is not None:
                self._last_stats = stats.total()
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _after_manual_scale(self) -> None:
        """Hook for per-group strategies to follow a manual ``update(new_scale)``."""

    def _clamp(self) -> None:
        if self._min_scale is not None or self._max_scale is not None:
            assert self._scale is not None
            self._scale.clamp_(min=self._min_scale, max=self._max_scale)

    # ------------------------------------------------------------------ queries
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Synchronises."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = v.greater_than("growth_factor", new_factor, 1.0)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = v.open_interval("backoff_factor", new_factor, 0.0, 1.0)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = v.int_at_least("growth_interval", new_interval, 1)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def telemetry(self) -> dict[str, torch.Tensor]:
        """Device tensors describing the last completed :meth:`update` (no sync; read them at
        your logging interval). Empty before the first :meth:`scale` or when disabled."""
        if not self._enabled or self._scale is None:
            return {}
        s = self._last_stats
        numel = s.numel.clamp(min=1).double()
        t = {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "found_inf": self._last_found_inf.clone(),
            "skipped_steps": self._skipped.clone(),
            "grad_absmax": s.absmax.reshape(()).clone(),
            "grad_norm": s.sumsq.reshape(()).sqrt(),
            "grad_zero_frac": (s.zeros / numel).float().reshape(()),
            "grad_subnormal_frac": (s.subnormals / numel).float().reshape(()),
        }
        t.update(self._extra_telemetry())
        return t

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The strategy's state as plain Python values (loadable with ``weights_only=True``).

        Holds GradScaler's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) — so GradScaler can load a ``native`` state —
        plus ``strategy``, ``skipped_steps`` and the rule's own state. Empty when disabled.
        Call after :meth:`update`. Synchronises.
        """
        if not self._enabled:
            return {}
        return {
            "strategy": self.name,
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "skipped_steps": self._init_skipped if self._scale is None else int(self._skipped.item()),
            "extra": self._extra_state_dict() if self._scale is not None else dict(self._pending_extra),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a GradScaler state dict, for ``native``)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        saved = state_dict.get("strategy", self.name)
        if saved != self.name:
            raise ValueError(f"state_dict is from strategy {saved!r}, cannot load it into {self.name!r}")
        try:
            scale = float(state_dict["scale"])
            self._growth_factor = v.greater_than("growth_factor", state_dict["growth_factor"], 1.0)
            self._backoff_factor = v.open_interval("backoff_factor", state_dict["backoff_factor"], 0.0, 1.0)
            self._growth_interval = v.int_at_least("growth_interval", state_dict["growth_interval"], 1)
            tracker = int(state_dict["_growth_tracker"])
        except KeyError as e:
            raise ValueError(f"state_dict is missing the entry {e.args[0]!r}") from None
        self._init_scale = scale
        self._init_growth_tracker = tracker
        self._init_skipped = int(state_dict.get("skipped_steps", 0))
        extra = dict(state_dict.get("extra", {}))
        if self._scale is not None:
            assert self._growth_tracker is not None
            self._scale.fill_(scale)
            self._growth_tracker.fill_(tracker)
            self._skipped.fill_(self._init_skipped)
            self._load_extra_state(extra)
        else:
            self._pending_extra = extra

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, enabled={self._enabled}, "
            f"scale={'uninitialised' if self._scale is None else 'on ' + str(self._scale.device)})"
        )
