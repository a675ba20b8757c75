"""Device state: a rule declares named tensors with initial values; the base class does the rest.

A declaration is a :class:`State` (name, dtype, initial value or a function of the parameters,
whether it has one entry per layer group, whether checkpoints keep it, its lowest valid value).
:class:`RuleState` holds the live tensors (``state.scale``, ``state.ema``, ...), turns them into
plain Python values for ``state_dict`` and back, and validates a loaded state completely before
anything is changed (:func:`validated`, :func:`from_state_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from strategies.sharding import all_reduce_
from strategies.stats import GradStats

__all__ = ["RuleState", "State", "base_state", "from_state_dict", "telemetry_of", "to_state_dict", "validated"]


@dataclass(frozen=True)
class State:
    """One named device tensor of a strategy.

    Args:
        name: attribute name (``strategy.state.<name>``), telemetry key and ``state_dict`` key.
        dtype: ``torch.float32``, ``torch.int32`` or ``torch.int64`` (what the kernels take).
        init: initial value, or the name of the ``Params`` field that holds it.
        per_group: shape ``[G]`` (one entry per layer group) instead of ``[]``.
        length: a fixed length ``L`` (or the name of the ``Params`` field holding it): shape ``[L]``, every entry
            starting at ``init`` (e.g. a ring buffer); not with ``per_group``. Saved as a list.
        when: ``when(params) -> bool``: the state exists only for parameters where it is true
            (e.g. a fault flag only when the rule may raise); default: always.
        saved: kept in ``state_dict`` (telemetry-only values are not).
        low: the smallest valid value when loading (``None``: any); floats must also be finite.
        reduce: ``"sum"`` or ``"max"``: under ``torch.distributed`` the base class reduces this
            tensor across ranks before ``update_`` (a rank-local observation, e.g. a histogram of
            each rank's activation gradients), so every rank decides alike.
    """

    name: str
    dtype: torch.dtype
    init: float | int | str = 0
    per_group: bool = False
    saved: bool = True
    low: float | None = None
    reduce: str | None = None
    length: int | str | None = None
    when: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.per_group and self.length is not None:
            raise ValueError(f"State {self.name!r}: per_group and length exclude each other")

    def present(self, params: Any) -> bool:
        return self.when is None or bool(self.when(params))

    def initial(self, params: Any) -> float | int:
        return getattr(params, self.init) if isinstance(self.init, str) else self.init

    def shape(self, params: Any, num_groups: int) -> tuple[int, ...]:
        """``[G]`` per group, ``[L]`` with a fixed length, else ``[]``."""
        if self.per_group:
            return (num_groups,)
        if self.length is not None:
            return (int(getattr(params, self.length)) if isinstance(self.length, str) else self.length,)
        return ()


class ScaleFloorError(ValueError):
    """A rule's fault (e.g. an overflow with the scale already at ``min_scale`` and
    ``on_min_scale="raise"``) ended training; the message is one line naming the step."""


FAULT_STATE = State("fault", torch.int64, 0, low=0)
"""A rule that must end training writes the 1-based update number of the fault here, on the
device (0: none; the first fault is kept); :class:`strategies.base.Strategy` reads it with the
skip decision in ``step()`` (its one host read) or at ``get_scale()``, and raises."""


def raise_fault(strategy: Any, step: int) -> None:
    """Raise :class:`ScaleFloorError` for a recorded fault (``step > 0``)."""
    if step:
        raise ScaleFloorError(
            f"{strategy.name}: step {step}: gradients overflowed with the loss scale at its floor "
            f"(min_scale={strategy.params.min_scale!r}, on_min_scale='raise'); stopping. Lower the "
            "learning rate, clip gradients or lower min_scale"
        )


def base_state(per_group: bool) -> tuple[State, ...]:
    """The state every strategy has: GradScaler's scale and growth tracker, plus skip counters."""
    return (
        State("scale", torch.float32, "init_scale", per_group=per_group, low=0.0),
        State("growth_tracker", torch.int32, 0, per_group=per_group, low=0),
        State("skipped_steps", torch.int64, 0, low=0),
        State("found_inf", torch.float32, 0.0, saved=False),
    )



def record_step_(scale: torch.Tensor, skipped_steps: torch.Tensor, found_state: torch.Tensor,
                 found_inf: torch.Tensor, min_scale: float | None, max_scale: float | None) -> None:
    """The end of every update (:meth:`Strategy.update`), in place: the scale(s) clamped to
    ``[min_scale, max_scale]`` where given, ``skipped_steps`` + 1 when ``found_inf != 0``, and
    ``found_state`` set to that. The Python twin of ``torch.ops.scalelab.record_step_`` (one op
    instead of four per step)."""
    if min_scale is not None or max_scale is not None:
        scale.clamp_(min=min_scale, max=max_scale)
    skipped = found_inf != 0
    skipped_steps.add_(skipped.to(torch.int64))
    found_state.copy_(skipped)


class RuleState:
    """The live state tensors of one strategy, by attribute (``state.scale``, ``state.ema``)."""

    def __init__(self, specs: Iterable[State], params: Any, num_groups: int, device: torch.device) -> None:
        self.specs = {s.name: s for s in specs}
        self.num_groups = num_groups
        for s in self.specs.values():
            setattr(self, s.name, torch.full(s.shape(params, num_groups), s.initial(params), dtype=s.dtype,
                                             device=device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.specs}

    def saved(self) -> dict[str, Any]:
        """Saved entries as Python numbers (per-group ones as lists). Synchronises."""
        return {n: getattr(self, n).tolist() for n, s in self.specs.items() if s.saved}

    def set_scale_(self, new_scale: float | torch.Tensor) -> None:
        """Every group's scale set to ``new_scale``: a float, or a 1-element tensor on the scale's
        device type (``GradScaler.update(new_scale)``'s contract and message)."""
        if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            self.scale.fill_(float(new_scale))
            return
        reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                  "torch.FloatTensor with requires_grad=False.")
        if not isinstance(new_scale, torch.Tensor) or new_scale.device.type != self.scale.device.type \
                or new_scale.numel() != 1 or new_scale.requires_grad:
            raise AssertionError(reason)
        self.scale.copy_(new_scale.reshape(()).expand_as(self.scale))

    def all_reduce_(self) -> None:
        """Reduce across ranks the rank-local observations the rule declared with ``reduce=``
        (the sums, then the maxima), so that every rank's update sees the same values."""
        all_reduce_([getattr(self, n) for n, s in self.specs.items() if s.reduce == "sum"], "sum")
        all_reduce_([getattr(self, n) for n, s in self.specs.items() if s.reduce == "max"], "max")

    def load_(self, values: dict[str, Any]) -> None:
        """Copy already :func:`validated` values into the tensors (a single value fills every
        entry: e.g. a scale set before ``attach`` split the strategy into groups)."""
        for name, value in values.items():
            t = getattr(self, name)
            v = torch.as_tensor(value, dtype=t.dtype)
            t.copy_(v.reshape(()).expand(t.shape) if v.numel() == 1 else v.reshape(t.shape))


def _number(key: str, value: Any, spec: State) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"state_dict entry {key!r} must be a number, got {value!r}")
    if spec.dtype.is_floating_point:
        if not math.isfinite(value):
            raise ValueError(f"state_dict entry {key!r} must be finite, got {value!r}")
    elif not float(value).is_integer():
        raise ValueError(f"state_dict entry {key!r} must be an integer, got {value!r}")
    if spec.low is not None and (value < spec.low or (spec.name == "scale" and value <= 0)):
        bound = "> 0" if spec.name == "scale" else f">= {spec.low:g}"
        raise ValueError(f"state_dict entry {key!r} must be {bound}, got {value!r}")
    return float(value) if spec.dtype.is_floating_point else int(value)


def validated(specs: Iterable[State], values: dict[str, Any], num_groups: int, params: Any = None) -> dict[str, Any]:
    """Check every entry of ``values`` that a spec names (type, finiteness, bound, length) and
    return them normalised; raise one ``ValueError`` naming the first bad key. Unknown keys are
    ignored and missing ones keep their current values. ``params`` sizes fixed-length states."""
    out: dict[str, Any] = {}
    for spec in specs:
        if not spec.saved or spec.name not in values:
            continue
        value = values[spec.name]
        if spec.length is not None:
            (n,) = spec.shape(params, num_groups)
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(f"state_dict entry {spec.name!r} must be a list of {n} numbers, got a "
                                 f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (list, tuple)) else ""))
            out[spec.name] = [_number(f"{spec.name}[{i}]", x, spec) for i, x in enumerate(value)]
        elif spec.per_group:
            if not isinstance(value, (list, tuple)) or len(value) != num_groups:
                raise ValueError(
                    f"state_dict entry {spec.name!r} must be a list of {num_groups} numbers (one per group), "
                    f"got {value!r}"
                )
            out[spec.name] = [_number(f"{spec.name}[{i}]", x, spec) for i, x in enumerate(value)]
        else:
            out[spec.name] = _number(spec.name, value, spec)
    return out


def to_state_dict(strategy: Any) -> dict[str, Any]:
    """``strategy.state_dict()`` of an enabled strategy (see :meth:`Strategy.state_dict`)."""
    extra = strategy.state.saved() if strategy.state is not None else dict(strategy._pending)
    skipped = int(extra.pop("skipped_steps", 0))
    if not strategy.per_group:  # top-level, as GradScaler's; per-group vectors stay in extra
        extra.pop("scale", None)
        extra.pop("growth_tracker", None)
    p = strategy.params
    return {
        "strategy": strategy.name,
        "scale": float(strategy._output_value("scale", strategy.params.init_scale)),  # no fault check: saving works
        "growth_factor": p.growth_factor,
        "backoff_factor": p.backoff_factor,
        "growth_interval": p.growth_interval,
        "_growth_tracker": strategy._get_growth_tracker(),
        "skipped_steps": skipped,
        "updates": strategy.updates,
        "group_names": strategy.group_names,
        "extra": extra,
    }


def from_state_dict(strategy: Any, sd: Any) -> tuple[Any, int, dict[str, Any]]:
    """Validate ``sd`` completely against ``strategy``; return ``(params, updates, values)`` to
    apply. Raises one ``ValueError`` naming the first bad entry (``RuntimeError`` for an empty
    dict, as GradScaler)."""
    if not isinstance(sd, dict):
        raise ValueError(f"state_dict must be a dict, got {type(sd).__name__}")
    if len(sd) == 0:
        raise RuntimeError("The source state dict is empty, possibly because it was saved "
                           "from a disabled instance of GradScaler.")
    saved = sd.get("strategy", strategy.name)
    if saved != strategy.name:
        raise ValueError(f"state_dict is from strategy {saved!r}, cannot load it into {strategy.name!r}")
    missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
               if k not in sd]
    if missing:
        raise ValueError(f"state_dict is missing the entry {missing[0]!r}")
    params = strategy.params.replace(growth_factor=sd["growth_factor"], backoff_factor=sd["backoff_factor"],
                                     growth_interval=sd["growth_interval"])
    groups, names = strategy.num_groups, sd.get("group_names", strategy.group_names)
    if strategy.per_group and list(names) != strategy.group_names:
        raise ValueError(f"state_dict has groups {list(names)}, this strategy has {strategy.group_names}; "
                         "attach(model) the same way before loading")
    extra = sd.get("extra", {})
    if not isinstance(extra, dict):
        raise ValueError(f"state_dict entry 'extra' must be a dict, got {extra!r}")
    values = {**extra, "scale": sd["scale"], "growth_tracker": sd["_growth_tracker"],
              "skipped_steps": sd.get("skipped_steps", 0)}
    top = validated(base_state(False), values, 1)  # GradScaler's entries, also for per-group rules
    if strategy.per_group:  # the per-group vectors live in extra; the top level holds the loss side's
        values["scale"] = extra.get("scale", [top["scale"]] * groups)
        values["growth_tracker"] = extra.get("growth_tracker", [top["growth_tracker"]] * groups)
    values = validated(strategy._specs(), values, groups, params)
    lo, hi = params.min_scale, params.max_scale
    for s in values["scale"] if isinstance(values["scale"], list) else [values["scale"]]:
        if (lo is not None and s < lo) or (hi is not None and s > hi):
            raise ValueError(f"state_dict entry 'scale' must be within [min_scale={lo}, max_scale={hi}], got {s!r}")
    updates = sd.get("updates", 0)
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
        raise ValueError(f"state_dict entry 'updates' must be a non-negative integer, got {updates!r}")
    return params, updates, values


def telemetry_of(strategy: Any) -> dict[str, torch.Tensor]:
    """``strategy.telemetry()`` of an initialised, enabled strategy (see its docstring)."""
    tensors = strategy.state.tensors()
    t = {name: value.clone() for name, value in tensors.items()}
    gt = tensors["growth_tracker"]
    t["scale"] = strategy.output_scale().clone()
    t["growth_tracker"] = strategy.output_entry(gt).clone()
    s = strategy._last_stats
    if s is None:
        s = GradStats.empty(strategy.num_groups, strategy.state.scale.device)
        s.absmax.fill_(math.nan)
        s.sumsq.fill_(math.nan)
    if strategy.per_group:
        t["scales"] = tensors["scale"].clone()
        t["group_growth_tracker"] = gt.clone()
        t["group_absmax"] = s.absmax.clone()
        t["group_zero_frac"] = (s.zeros / s.numel.clamp(min=1).double()).float()
    total = s.total()
    numel = total.numel.clamp(min=1).double()
    t["grad_absmax"] = total.absmax.reshape(()).clone()
    t["grad_norm"] = total.sumsq.reshape(()).sqrt()
    t["grad_zero_frac"] = (total.zeros / numel).float().reshape(())
    t["grad_subnormal_frac"] = (total.subnormals / numel).float().reshape(())
    return t
