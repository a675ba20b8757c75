"""From a strategy's telemetry (device tensors) and the gradients to the fields of a train line.

The loop knows no strategy's name or keys; the mapping is generic and driven by the schema:

* a telemetry key that names a field of the train line (``schema.TRAIN_FIELDS``: ``scale``,
  ``grad_absmax``, ``grad_norm``, ``grad_zero_frac``, ``grad_subnormal_frac``, ``scales``,
  ``probe_time_s``, ...) fills that field;
* a 1-D tensor with one entry per layer group (``len(strategy.group_names)``) is per-group; the
  ``scales`` field then also gets ``scale_groups`` (the group names, same order);
* every other key (``growth_tracker``, ``found_inf``, ``skipped_steps``, a rule's own state such
  as ``ema``, per-group lists, ...) goes, as a number or a list, into the line's ``telemetry`` dict.

The gradient fields fall back to the loop's own measurement (:func:`param_grad_stats`) when the
strategy does not report them (scaling off, or a strategy without statistics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from experiments import schema
from strategies.sharding import all_reduce_, local
from strategies.stats import zeros_and_subnormals

__all__ = ["GRAD_FIELDS", "OptimizerClock", "param_grad_stats", "flatten", "read"]

GRAD_FIELDS = ("grad_absmax", "grad_norm", "grad_zero_frac", "grad_subnormal_frac")
_SCALE, _SCALES, _GROUPS, _EXTRA = "scale", "scales", "scale_groups", "telemetry"


def param_grad_stats(params: Sequence[torch.nn.Parameter]) -> dict[str, float]:
    """abs-max, L2 norm, zero and fp16-subnormal fractions of the parameter gradients (one sync).
    FSDP2 shards (DTensors): each rank measures its own shards, reduced over the ranks (every rank
    calls it)."""
    if any(isinstance(p.grad, DTensor) for p in params):
        return _sharded_grad_stats([local(p.grad.detach()) for p in params if p.grad is not None])
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return dict(zip(GRAD_FIELDS, (0.0, 0.0, 1.0, 0.0)))
    absmax = torch.stack([g.abs().max().float() for g in grads]).max()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    zeros, sub = zeros_and_subnormals(grads)
    numel = sum(g.numel() for g in grads)
    a, n, z, s = torch.stack([absmax, norm, zeros.float(), sub.float()]).tolist()  # type: ignore[union-attr]
    return dict(zip(GRAD_FIELDS, (a, n, z / numel, s / numel)))


def _sharded_grad_stats(shards: list[torch.Tensor]) -> dict[str, float]:
    """:func:`param_grad_stats` of the whole gradient from each rank's shards: MAX of the abs-max, SUM
    of the squares and counts over the ranks."""
    dev = shards[0].device if shards else torch.device("cpu")
    shards = [g for g in shards if g.numel()]
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    peak = torch.stack([zero] + [g.abs().max().double() for g in shards]).max().reshape(1)
    sq = torch.stack([zero] + [g.double().square().sum() for g in shards]).sum()
    zeros, sub = zeros_and_subnormals(shards) if shards else (zero, zero)
    sums = torch.stack([sq, zeros.double(), sub.double(), zero + sum(g.numel() for g in shards)])
    all_reduce_([peak], "max")
    all_reduce_([sums], "sum")
    (a,), (q, z, s, n) = peak.tolist(), sums.tolist()
    return dict(zip(GRAD_FIELDS, (a, q ** 0.5, z / n, s / n) if n else (0.0, 0.0, 1.0, 0.0)))


def read(strategy: Any) -> dict[str, Any]:
    """The strategy's telemetry tensors (empty when scaling is off): no sync here."""
    if not strategy.is_enabled():
        return {}
    return dict(strategy.telemetry())


def _plain(value: Any) -> Any:
    """A tensor as a Python number (0-d or one element) or list; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else value.tolist()
    return value


def flatten(tel: Mapping[str, Any], group_names: Sequence[str], own_grad_stats: Mapping[str, float]) -> dict[str, Any]:
    """The train-line fields from telemetry ``tel`` (see the module docstring); one read per tensor."""
    groups = list(group_names)
    out: dict[str, Any] = {_SCALE: 1.0}
    extra: dict[str, Any] = {}
    for key, value in tel.items():
        per_group = isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == len(groups)
        field = schema.TRAIN_FIELDS.get(key)
        plain = _plain(value)
        if field is not None and field.type is float and isinstance(plain, (int, float)):
            out[key] = float(plain)
        elif field is not None and field.type == "float_list" and per_group:
            out[key] = [float(v) for v in plain]
            if key == _SCALES:
                out[_GROUPS] = groups
        else:
            extra[key] = plain
    if not all(k in out for k in GRAD_FIELDS):
        out.update(own_grad_stats)
    if extra:
        out[_EXTRA] = extra
    return out


class OptimizerClock:
    """Optimizer step hooks: time spent inside ``optimizer.step`` and whether it ran this step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.elapsed = 0.0
        self.ran = False
        self._t0 = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.elapsed += time.perf_counter() - self._t0
        self.ran = True

    def reset(self) -> None:
        self.elapsed, self.ran = 0.0, False
