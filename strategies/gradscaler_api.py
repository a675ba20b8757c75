"""GradScaler's accessor surface for :class:`strategies.base.Strategy`: the getters and setters,
``is_enabled``, and the private members frameworks read from a ``torch.amp.GradScaler``
(``_scale``, ``_growth_tracker``, ``_enabled``, ``_lazy_init_scale_growth_tracker``, pickling).
Kept apart so that ``base.py`` is the state machine alone.
"""

from __future__ import annotations

from typing import Any

import torch


class GradScalerAccessors:
    """Mixed into :class:`strategies.base.Strategy` before ``torch.amp.GradScaler``; reads
    ``self.params`` (the validated hyper-parameters) and ``self.state`` (the device state)."""

    params: Any
    state: Any

    _scale = property(lambda self: None if self.state is None else self.state.scale)
    _growth_tracker = property(lambda self: None if self.state is None else self.state.growth_tracker)
    _enabled = property(lambda self: self.params.enabled)

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
