"""The doctor's passes over one step, and what they measure (``strategies.doctor`` decides from
the :class:`Measured` that :func:`measure` returns; its docstring states the method and the sources).

1. **fp32**: forward and backward with autocast off: the reference gradient ``r`` and the fp32
   activation-gradient abs-max of each module (:mod:`strategies.doctor.passes`);
2. **mixed**: forward under ``torch.autocast``, backward of ``loss * S``, and of ``loss * 1``
   through the same graph when that overflows; with ``compare_strategies``, one backward per
   compared strategy (:mod:`strategies.doctor.compare`) and one per distinct scale they choose
   (plus the largest power of two with 2x headroom under the overflow bound) to measure its damage.

:class:`LayerDamage` rows: ``lost = #{r != 0, g == 0} / #{r != 0}`` and
``cosine = <g, r> / (||g|| ||r||)`` of the unscaled mixed gradient ``g`` against the fp32 ``r``
per layer, with the overflow flag from the shared statistics pass (``strategies.stats``).

The model's weights, ``.grad``, buffers and RNG state (CPU, and CUDA for a CUDA model) are left
as they were.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils._pytree import tree_leaves

import strategies
from strategies.block_recipes import Recipe
from strategies.doctor.block_clip import BlockClip, measure_block_clipping
from strategies.doctor.compare import strategy_scales
from strategies.doctor.passes import Record, first_backward, hooks, safe_scale
from strategies.doctor.verdict import LayerDamage
from strategies.grad_compare import RngState, capture_rng, layer_of, layer_sums, restore_rng
from strategies.stats import unscale_and_stats_reference

__all__ = ["DTYPES", "LossFn", "Measured", "measure"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The formats the doctor diagnoses, as ``torch.autocast`` dtypes."""


LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` (the forward included)."""


@dataclass
class Measured:
    """Everything the passes measured; :func:`strategies.doctor.decide.decide` turns it into a
    :class:`strategies.doctor.verdict.Diagnosis`. The passes fill in the fields after ``prior_norm``."""

    precision: str
    scale: float
    fmax: float
    bad_inputs: list[str]  # non-finite batch tensors or parameters
    prior_norm: float  # ||.grad|| the step started with
    ref: list[torch.Tensor] = field(default_factory=list)  # the fp32 gradient
    ref_norm: float = 0.0
    ref_loss: float = math.nan
    ref_rec: Record = field(default_factory=lambda: Record(backward_on=True, wide=True))
    rec: Record = field(default_factory=Record)
    fp32_finite: bool = False
    fwd_finite: bool = False
    grads_finite: bool = False
    at_one_finite: bool = True
    back_first: tuple[str, str] | None = None
    per_layer: list[LayerDamage] = field(default_factory=list)
    chosen: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    block_clips: list[BlockClip] = field(default_factory=list)  # with blocks: strategies.doctor.block_clip


@dataclass
class _Step:
    """One step of the user's model: what every pass needs."""

    model: torch.nn.Module
    loss_fn: LossFn
    batch: Any
    params: list[torch.nn.Parameter]
    dev: str  # the autocast device type
    dtype: torch.dtype
    names: list[str]  # the layers
    index: list[int]  # each parameter's layer


def _cuda(dev: torch.device) -> list[torch.device]:
    return [dev] if dev.type == "cuda" else []


@contextlib.contextmanager
def _preserved(model: torch.nn.Module, dev: torch.device) -> Iterator[None]:
    """Leave ``.grad``, buffers and the RNG state (CPU, and ``dev`` when CUDA) exactly as they were."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    with torch.random.fork_rng(devices=_cuda(dev)):
        try:
            yield
        finally:
            for p, g in grads.items():
                p.grad = g
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])


def _layer_index(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> tuple[list[str], list[int]]:
    owner = layer_of(model)
    names = list(dict.fromkeys(owner.get(id(p), "other") for p in params))
    return names, [names.index(owner.get(id(p), "other")) for p in params]


def _damage(grads: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], scale: float,
            names: list[str], index: list[int]) -> list[LayerDamage]:
    """Per layer: lost fraction and cosine of ``grads / scale`` against ``ref``; overflow via the
    shared statistics pass (``strategies.stats``)."""
    work = [g.detach().float().clone() for g in grads]
    device = work[0].device
    stats = unscale_and_stats_reference(work, torch.tensor(1.0 / scale, device=device), index, len(names))
    sums = layer_sums(zip(work, ref), index, len(names), device)
    out = []
    rows, found = sums.tolist(), stats.found_inf.tolist()
    for i, name in enumerate(names):
        dot, gg, rr, _, nz, lost = rows[i]  # strategies.grad_compare.LAYER_SUMS
        cos = dot / math.sqrt(gg * rr) if gg > 0 and rr > 0 else float("nan")
        out.append(LayerDamage(name, scale, lost / nz if nz else 0.0, cos, found[i] > 0))
    return out


def _backward(loss: torch.Tensor, params: list[torch.nn.Parameter], scale: float) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss * scale, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach().float() for g, p in zip(grads, params)]


def _bad_inputs(model: torch.nn.Module, batch: Any) -> list[str]:
    bad = [f"parameter {n} holds {int((~torch.isfinite(p)).sum())} NaN/Inf entries (the weights are already lost)"
           for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())][:3]
    return bad + [f"batch tensor {i} ({tuple(t.shape)}) holds {int((~torch.isfinite(t)).sum())} NaN/Inf entries"
                  for i, t in enumerate(tree_leaves(batch))
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _norm(tensors: Sequence[torch.Tensor | None]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors if t is not None))


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _fp32_pass(step: _Step, m: Measured) -> None:
    """The reference gradient and the activation-gradient magnitudes, autocast off."""
    with hooks(step.model, m.ref_rec, step.dev), torch.autocast(step.dev, enabled=False), torch.enable_grad():
        ref_loss = step.loss_fn(step.model, step.batch).float()
        m.passes["forward"] += 1
        m.fp32_finite = bool(torch.isfinite(ref_loss).all())
        m.ref = _backward(ref_loss, step.params, 1.0) if m.fp32_finite else [torch.zeros_like(p) for p in step.params]
        m.passes["backward"] += int(m.fp32_finite)
    m.ref_loss = float(ref_loss.detach())


def _mixed_forward(step: _Step, m: Measured) -> torch.Tensor:
    """The loss under autocast (inside :func:`strategies.doctor.passes.hooks` on ``m.rec``)."""
    with torch.autocast(step.dev, dtype=step.dtype):
        loss = step.loss_fn(step.model, step.batch)
    m.passes["forward"] += 1
    loss = loss.float()
    m.fwd_finite = bool(torch.isfinite(loss).all())
    return loss


def _mixed_backward(step: _Step, m: Measured, loss: torch.Tensor) -> None:
    """The backward at ``S``: damage against fp32, and where it overflows whether it does at 1 too."""
    m.rec.backward_on = True
    grads = _backward(loss, step.params, m.scale)
    m.passes["backward"] += 1
    m.rec.backward_on = False
    m.grads_finite = _all_finite(grads)
    if m.fp32_finite:
        m.per_layer = _damage(grads, m.ref, m.scale, step.names, step.index)
    if not m.grads_finite:
        m.back_first = first_backward(step.model, step.params, grads, m.rec)
        m.at_one_finite = _all_finite(_backward(loss, step.params, 1.0))
        m.passes["backward"] += 1


def _compare(step: _Step, m: Measured, loss: torch.Tensor, rng: RngState, names: Sequence[str],
             forward_strategies: bool) -> None:
    """The scale each strategy of ``names`` chooses, and the damage at each such scale (and at the
    largest power of two with 2x headroom under the overflow bound)."""
    device = step.params[0].device

    def reference() -> torch.Tensor:
        with torch.autocast(step.dev, enabled=False):
            return step.loss_fn(step.model, step.batch).float()

    def fresh() -> torch.Tensor:
        restore_rng(rng, device)
        with torch.autocast(step.dev, dtype=step.dtype):
            return step.loss_fn(step.model, step.batch).float()

    m.chosen, m.skipped, forwards = strategy_scales(names, loss, step.params, step.model, reference,
                                                    fresh if forward_strategies else None)
    m.passes["forward"] += forwards
    m.passes["backward"] += len(m.chosen)
    bound = safe_scale(m.fmax, m.ref_rec, m.ref)
    candidates = set(m.chosen.values())
    if math.isfinite(bound) and bound >= 2.0:
        candidates.add(2.0 ** math.floor(math.log2(bound / 2)))  # the largest pow2 with 2x headroom
    for s in sorted(candidates - {m.scale}):
        m.per_layer += _damage(_backward(loss, step.params, s), m.ref, s, step.names, step.index)
        m.passes["backward"] += 1


def measure(model: torch.nn.Module, loss_fn: LossFn, batch: Any, params: list[torch.nn.Parameter],
            precision: str, S: float, dev: str, compare_strategies: bool,
            strategy_names: Sequence[str] | None, forward_strategies: bool,
            blocks: Mapping[str, Recipe] | None = None) -> Measured:
    """The fp32 pass, then the mixed pass (module docstring), with the model left as it was; with
    ``blocks`` (role -> recipe) one more fp32 forward and backward measures the block clipping."""
    names, index = _layer_index(model, params)
    prior_norm = _norm([p.grad for p in params])
    m = Measured(precision, S, float(torch.finfo(DTYPES[precision]).max), _bad_inputs(model, batch), prior_norm)
    step = _Step(model, loss_fn, batch, params, dev, DTYPES[precision], names, index)
    device = params[0].device
    with _preserved(model, device):
        rng = capture_rng(device)
        _fp32_pass(step, m)
        restore_rng(rng, device)
        if blocks and m.fp32_finite:
            m.block_clips = measure_block_clipping(model, loss_fn, batch, blocks, dev)
            m.passes["forward"] += 1
            m.passes["backward"] += 1
            restore_rng(rng, device)
        with hooks(model, m.rec, dev), torch.enable_grad():  # mixed: the same graph for every backward
            loss = _mixed_forward(step, m)
            if m.fwd_finite:
                _mixed_backward(step, m, loss)
                if compare_strategies and m.fp32_finite:
                    _compare(step, m, loss, rng, strategy_names or strategies.available(), forward_strategies)
    m.ref_norm = _norm(m.ref)
    return m
