"""Hyper-parameters: one validated dataclass per rule, also the Hydra schema of its YAML.

Each field is declared once with :func:`hp` — its type (the annotation), default, allowed range
(a check from :mod:`strategies.validation`) and source — in the style of TransformerEngine's
recipe dataclasses. Building the dataclass validates every field and normalises it (``1`` ->
``1.0`` for floats), raising one line such as ``growth_factor must be > 1, got 0.5``; a rule adds
cross-field checks in :meth:`ScalerParams.check`.

``OmegaConf.structured(cls)`` of any of these classes is the schema of ``conf/strategy/<name>.yaml``
(the tests merge every YAML into its rule's schema).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from strategies import validation as v

__all__ = ["DISTRIBUTED_MODES", "ScalerParams", "hp", "describe"]

DISTRIBUTED_MODES = ("auto", "off", "replicated", "sharded")


def hp(default: Any, check: v.Check, source: str = "", doc: str = "") -> Any:
    """Declare one hyper-parameter: ``name: type = hp(default, check, source, doc)``."""
    return dataclasses.field(default=default, metadata={"check": check, "source": source, "doc": doc})


@dataclass
class ScalerParams:
    """``torch.amp.GradScaler``'s arguments (same order: device first) plus scalelab's common ones.

    Args:
        device: pin the state's device; default (None): the device of the first tensor given to
            ``scale()``. Positional first argument, as GradScaler's.
        init_scale: initial scale S_0 (finite, > 0). Default 2^16, as torch.
        growth_factor: factor > 1 by which the rule may grow S. Default 2.
        backoff_factor: factor in (0, 1) applied to S on non-finite gradients. Default 0.5.
        growth_interval: integer >= 1; how many clean steps a rule waits before growing.
        enabled: ``False`` makes every method a transparent no-op (``step`` just steps).
        min_scale, max_scale: optional bounds; after every update S is clamped into them (off by
            default, as torch, so ``native`` stays bit-identical to GradScaler).
        track_stats: gather gradient statistics on every unscale for telemetry. Rules that read
            them (``needs_stats``) gather them regardless.
        distributed: ``"auto"`` (all-reduce statistics when ``torch.distributed`` is initialised,
            as replicated gradients), ``"off"``, ``"replicated"`` (DDP: MAX-reduce) or
            ``"sharded"`` (FSDP/ZeRO: MAX for found_inf/abs-max, SUM for sums and counts).
    """

    device: Optional[str] = hp(None, v.device, "torch.amp.GradScaler")
    init_scale: float = hp(2.0**16, v.finite_positive, "torch.amp.GradScaler")
    growth_factor: float = hp(2.0, v.above(1.0), "torch.amp.GradScaler")
    backoff_factor: float = hp(0.5, v.between(0.0, 1.0), "torch.amp.GradScaler")
    growth_interval: int = hp(2000, v.integer(1), "torch.amp.GradScaler")
    enabled: bool = hp(True, v.boolean, "torch.amp.GradScaler")
    min_scale: Optional[float] = hp(None, v.optional(v.finite_positive), "Megatron-LM, DeepSpeed")
    max_scale: Optional[float] = hp(None, v.optional(v.finite_positive), "scalelab")
    track_stats: bool = hp(True, v.boolean, "scalelab")
    distributed: str = hp("auto", v.choice(*DISTRIBUTED_MODES), "scalelab")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                setattr(self, f.name, check(f.name, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Cross-field checks (a subclass calls ``super().check()`` and adds its own)."""
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got min_scale={self.min_scale!r} > max_scale={self.max_scale!r}"
            )

    def replace(self, **changes: Any) -> "ScalerParams":
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def describe(params_cls: type[ScalerParams]) -> list[dict[str, Any]]:
    """One row per hyper-parameter (name, type, default, source, doc): for docs and reports."""
    return [
        {"name": f.name, "type": str(f.type), "default": f.default,
         "source": f.metadata.get("source", ""), "doc": f.metadata.get("doc", "")}
        for f in dataclasses.fields(params_cls)
    ]
