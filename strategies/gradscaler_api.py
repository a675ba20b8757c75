"""GradScaler's accessor surface for :class:`strategies.base.Strategy`: ``get_scale``, the getters
and setters, ``is_enabled``, ``state_dict``/``load_state_dict`` (validated and written by
:mod:`strategies.state`), and the private members frameworks read from a ``torch.amp.GradScaler``
(``_lazy_init_scale_growth_tracker``, pickling, and every instance attribute GradScaler's
``__init__`` sets — ``_device``, ``_enabled``, ``_init_scale``, ``_scale``, ``_growth_factor``,
``_backoff_factor``, ``_growth_interval``, ``_init_growth_tracker``, ``_growth_tracker``, with
``_per_optimizer_states`` set by the base). Kept apart so that ``base.py`` is the state machine alone.
"""

from __future__ import annotations

from typing import Any

import torch

from strategies import validation as v
from strategies.state import from_state_dict, raise_fault, to_state_dict

__all__ = ["GradScalerAccessors"]


class GradScalerAccessors:
    """Mixed into :class:`strategies.base.Strategy` before ``torch.amp.GradScaler``; reads
    ``self.params`` (the validated hyper-parameters) and ``self.state`` (the device state)."""

    params: Any
    state: Any
    _pending: dict[str, Any]
    _init_values: dict[str, Any]
    per_group: bool
    num_groups: int
    output_group: int
    updates: int

    _scale = property(lambda self: None if self.state is None else self.state.scale)
    _growth_tracker = property(lambda self: None if self.state is None else self.state.growth_tracker)
    _enabled = property(lambda self: self.params.enabled)
    # GradScaler's plain attributes, read and written through the validated parameters.
    _growth_factor = property(lambda self: self.get_growth_factor(), lambda self, v: self.set_growth_factor(v))
    _backoff_factor = property(lambda self: self.get_backoff_factor(), lambda self, v: self.set_backoff_factor(v))
    _growth_interval = property(lambda self: self.get_growth_interval(), lambda self, v: self.set_growth_interval(v))

    @property
    def _device(self) -> str | None:
        """GradScaler's device string: the ``device`` argument, else (default ``None``: the first
        scaled tensor's device) the state's device type once initialised."""
        if self.params.device is not None or self.state is None:
            return self.params.device
        return self.state.scale.device.type

    @property
    def _init_scale(self) -> float:
        """The scale the state starts from at its lazy initialisation (GradScaler: ``init_scale``,
        or the loaded state dict's ``scale``). Setting it before the first :meth:`scale` sets
        that start (validated: finite, > 0, within [min_scale, max_scale]); afterwards it is
        only recorded, as GradScaler (the live scale is unchanged: use ``update(new_scale)``)."""
        return self._init_values["scale"]

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._set_init("scale", self.params.replace(init_scale=value).init_scale)

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the state starts from (GradScaler: 0, or the loaded ``_growth_tracker``);
        set like :attr:`_init_scale`."""
        return self._init_values["growth_tracker"]

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        self._set_init("growth_tracker", v.int_at_least("_init_growth_tracker", value, 0))

    def _set_init(self, key: str, value: float | int) -> None:
        self._init_values = {**self._init_values, key: value}
        if self.state is None:  # per-group state: every group starts there
            self._pending = {**self._pending, key: [value] * self.num_groups if self.per_group else value}

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self.state is None:
            self._lazy_init(dev)

    def __getstate__(self) -> dict[str, Any]:
        if self.params.enabled and len(self._per_optimizer_states) != 0:
            raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                 "of an iteration, or at the end after scaler.update().")
        # A copy of these would silently act on the original's model (pickle and deepcopy alike).
        if getattr(self, "_handle", None) is not None:
            raise TypeError(f"{self.name}: an attached strategy cannot be pickled or copied (the model's hooks "
                            "call this instance); detach() it first, or save its state_dict()")
        if getattr(self, "_closure", None) is not None:
            raise TypeError(f"{self.name}: a strategy holding a reference closure cannot be pickled or copied "
                            "(the copy would probe the original model); save its state_dict() and call "
                            "set_reference on the new one")
        return self.__dict__.copy()

    # ------------------------------------------------------------------ the scale
    def get_scale(self) -> float:
        """The current (loss-side) scale as a Python float (1.0 when disabled). Synchronises.
        Raises :class:`strategies.state.ScaleFloorError` if the rule recorded a fault
        (:class:`strategies.base.Strategy`)."""
        self.guard("get_scale()")
        if not self.params.enabled:
            return 1.0
        if self.state is not None and "fault" in self.state.specs:
            scale, fault = torch.stack([self.output_scale().double(), self.state.fault.double()]).tolist()
            raise_fault(self, int(fault))
            return float(scale)
        return float(self._output_value("scale", self.params.init_scale))

    def _output_value(self, key: str, default: float) -> float:
        """The loss-side group's entry ``key`` of the state, or of a loaded one not yet
        initialised. Synchronises."""
        if self.state is None:
            value = self._pending.get(key, default)
            return value[min(self.output_group, len(value) - 1)] if isinstance(value, list) else value
        return self.output_entry(getattr(self.state, key)).item()

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
        self._ranks_agree = False  # under a process group the next step checks the ranks hold the same state
        # GradScaler.load_state_dict sets _init_scale / _init_growth_tracker (both validated above)
        self._init_values = {"scale": float(state_dict["scale"]), "growth_tracker": int(state_dict["_growth_tracker"])}
        if self.state is not None:
            self.state.load_(values)
        else:
            self._pending = values

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

    def __repr__(self) -> str:
        where = "uninitialised" if self.state is None else f"on {self.state.scale.device}"
        return f"{type(self).__name__}(name={self.name!r}, enabled={self.params.enabled}, scale={where})"
