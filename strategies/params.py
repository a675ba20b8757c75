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
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Optional

from strategies import validation as v

__all__ = ["DISTRIBUTED_MODES", "GRADSCALER_POSITIONAL", "ScalerParams", "bind_arguments", "hp", "describe", "defaults",
           "signature", "sign_init"]

DISTRIBUTED_MODES = ("auto", "off", "replicated", "sharded")

GRADSCALER_POSITIONAL = ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
"""``torch.amp.GradScaler.__init__``'s parameters, in its order: the only ones a strategy takes
positionally; every other field (``min_scale``, ``max_scale``, the rule's own) is keyword-only."""


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
            default, as torch, so ``native`` stays bit-identical to GradScaler). ``init_scale``
            must lie within them: one outside is **refused** at construction (``init_scale must
            be within [min_scale=.., max_scale=..], got ..``) rather than clamped, so the first
            step never runs at a scale outside the bounds and no value is silently changed.
        track_stats: gather gradient statistics on every unscale for telemetry. Rules that read
            them (``needs_stats``) gather them regardless.
        distributed: ``"auto"`` (all-reduce statistics when ``torch.distributed`` is initialised;
            each gradient's layout detected: FSDP2 DTensor shards and FSDP1 flat parameters
            sharded, the rest replicated), ``"off"``, ``"replicated"`` (DDP: MAX-reduce) or
            ``"sharded"`` (FSDP/ZeRO: MAX for found_inf/abs-max, SUM for sums and counts; and
            ``ShardedGradScaler``'s semantics: the loss keeps its dtype, fp16 gradients are
            unscaled). See :mod:`strategies.sharding` and docs/strategy-api.md.
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
        self.check_init_scale()

    def check(self) -> None:
        """Cross-field checks (a subclass calls ``super().check()`` and adds its own)."""
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got min_scale={self.min_scale!r} > max_scale={self.max_scale!r}"
            )

    def check_init_scale(self) -> None:
        """``min_scale <= init_scale <= max_scale`` (where given), after the rule's own checks (a
        rule may normalise ``init_scale`` there, e.g. ``layerwise`` rounds it to a power of two)."""
        lo, hi = self.min_scale, self.max_scale
        if (lo is not None and self.init_scale < lo) or (hi is not None and self.init_scale > hi):
            v.fail("init_scale", f"within [min_scale={lo!r}, max_scale={hi!r}]", self.init_scale)

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


def defaults(cls: type) -> dict[str, Any]:
    """Every field of the dataclass ``cls`` and its default, as a config file writes it: the keys and
    defaults of its config node (e.g. the schema a ``conf/strategy/<name>.yaml`` merges onto, so
    that the YAML states only what differs). A tuple or set becomes a sorted list, a field whose
    type is a dataclass its own mapping, and a field without a default ``"???"`` (OmegaConf's
    missing value: the config must set it)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not resolve: no nested dataclass then
        hints = {}
    node: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            node[f.name] = defaults(hint)
        elif f.default is dataclasses.MISSING:
            node[f.name] = "???"
        elif isinstance(f.default, (tuple, frozenset, set)):
            node[f.name] = sorted(f.default) if isinstance(f.default, (set, frozenset)) else list(f.default)
        else:
            node[f.name] = f.default
    return node


@functools.lru_cache(maxsize=None)
def signature(params_cls: type[ScalerParams]) -> inspect.Signature:
    """The constructor signature of a strategy whose hyper-parameters are ``params_cls``:
    ``(self, device=None, init_scale=..., growth_factor=..., backoff_factor=..., growth_interval=...,
    enabled=True, *, min_scale=None, max_scale=None, ..., <the rule's own fields>) -> None`` —
    GradScaler's parameters in GradScaler's order (:data:`GRADSCALER_POSITIONAL`), then every
    other field keyword-only, in the dataclass's field order, each with the rule's default and type.
    What ``inspect.signature``, ``help()`` and IDEs show for ``Strategy.__init__``."""
    try:
        hints = typing.get_type_hints(params_cls)
    except (NameError, TypeError):  # an annotation that does not resolve: show it as written
        hints = {}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(params_cls):
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in GRADSCALER_POSITIONAL
                else inspect.Parameter.KEYWORD_ONLY)
        default = f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints.get(f.name, f.type)))
    params.sort(key=lambda p: p.kind)  # stable: keeps GradScaler's order, then the dataclass's
    return inspect.Signature(params, return_annotation=None)


def sign_init(cls: Any) -> None:
    """Give the strategy class ``cls`` an ``__init__`` whose ``__signature__`` is its ``Params``'
    (:func:`signature`): one thin forwarding function per class, so each class shows its own
    rule's fields."""
    inherited = cls.__init__

    @functools.wraps(inherited)
    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        inherited(self, *args, **kw)

    __init__.__signature__ = signature(cls.Params)  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__


def bind_arguments(strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Bind a strategy's constructor arguments against :func:`signature`: more than GradScaler's six
    positional ones, or an unknown keyword, is one ``TypeError`` naming the strategy."""
    try:
        signature(strategy.Params).bind(strategy, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{strategy.name}: {e} (GradScaler's six arguments may be positional, every other "
                        "one is a keyword)") from None
