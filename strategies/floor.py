"""The scale floor shared by the industry rules: ``min_scale`` with ``on_min_scale: clamp | raise``.

``clamp`` (default): S never goes below ``min_scale`` (the base class clamps after every update).
``raise``: the overflow that hits the floor ends training — DeepSpeed
``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``
(``raise_error_at_min_scale``: an overflow arriving with ``cur_scale == min_scale``) and fairseq
``fairseq/optim/dynamic_loss_scaler.py`` ``DynamicLossScaler.check_overflow`` (``min_loss_scale``:
the backed-off scale reaches it). Each rule states which of the two conditions it uses. The rule
records the step in the device flag ``fault`` (:data:`strategies.state.FAULT_STATE`, present only
with ``raise``) and the base class raises :class:`strategies.state.ScaleFloorError` at its existing
``step()`` host read — no extra synchronisation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from strategies import validation as v
from strategies.state import FAULT_STATE
from strategies.params import hp

__all__ = ["FLOOR_FAULT", "FloorParams", "ON_MIN_SCALE", "raises", "record_fault_"]

ON_MIN_SCALE = ("clamp", "raise")


def raises(params: object) -> bool:
    return getattr(params, "on_min_scale", "clamp") == "raise"


#: The ``fault`` state of a rule with ``on_min_scale``; declared only when it may raise.
FLOOR_FAULT = dataclasses.replace(FAULT_STATE, when=raises)


@dataclass
class FloorParams:
    """Mixin (before ``ScalerParams``): ``on_min_scale``; ``raise`` needs a ``min_scale``."""

    on_min_scale: str = hp("clamp", v.choice(*ON_MIN_SCALE), "DeepSpeed raise_error_at_min_scale; fairseq min_loss_scale",
                           "an overflow at min_scale: clamp (S stays at the floor) | raise (ScaleFloorError)")

    def check(self) -> None:
        super().check()  # type: ignore[misc]
        if self.on_min_scale == "raise" and self.min_scale is None:  # type: ignore[attr-defined]
            v.fail("min_scale", "a number when on_min_scale='raise'", None)


def record_fault_(fault: torch.Tensor, hit: torch.Tensor, step: int) -> None:
    """``fault <- step`` where ``hit`` and no earlier fault was recorded (in place, no sync)."""
    fault.copy_(torch.where(hit & (fault == 0), torch.full_like(fault, step), fault))
