"""The doctor's passes over one step: what they hook, record and compare (``strategies.doctor``
decides from what :func:`measure` returns; its docstring states the method and the sources).

* :func:`measure` runs the fp32 pass (reference gradient, fp32 activation-gradient magnitudes),
  then the mixed pass under autocast: forward hooks on every module find the first one whose
  finite inputs give a non-finite output that its fp32 recomputation does not have (so a
  ``-inf`` attention mask is no overflow); full backward hooks on the leaf modules find the
  first one, in backward order, whose finite output gradient gives a non-finite input gradient
  (or that owns a non-finite parameter gradient); the backward is repeated at ``S = 1`` when it
  overflows at ``S``, and at each compared strategy's scale.
* :class:`LayerDamage` rows: ``lost = #{r != 0, g == 0} / #{r != 0}`` and
  ``cosine = <g, r> / (||g|| ||r||)`` of the unscaled mixed gradient ``g`` against the fp32
  ``r`` per layer, with the overflow flag from the shared statistics pass (``strategies.stats``).

The model's weights, ``.grad``, buffers and RNG state (CPU, and CUDA for a CUDA model) are left
as they were.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_leaves

import strategies
from strategies.grad_compare import capture_rng, layer_of, layer_sums, restore_rng
from strategies.probe import ReferenceProbe
from strategies.stats import unscale_and_stats_reference

__all__ = ["DTYPES", "LayerDamage", "LossFn", "Measured", "Record", "backward_value", "measure", "safe_scale"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The formats the doctor diagnoses, as ``torch.autocast`` dtypes."""


LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` (the forward included)."""


@dataclass
class LayerDamage:
    """Underflow damage of one layer's gradient at one scale, against the fp32 gradient."""

    layer: str
    scale: float
    lost_frac: float
    cosine: float
    found_inf: bool


def _finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(obj)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _has_nan(obj: Any) -> bool:
    return any(bool(torch.isnan(t).any()) for t in tree_leaves(obj)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _absmax(obj: Any) -> float:
    vals = [float(t.detach().abs().max()) for t in tree_leaves(obj)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return max(vals, default=0.0)


def _out_of_range(low: Any, wide: Any) -> tuple[float, bool]:
    """Compare a low-precision output with its fp32 recomputation: ``(value, new)`` where ``new``
    says the low-precision output has non-finite entries the fp32 one lacks, and ``value`` is the
    largest fp32 magnitude at those entries (``inf`` when fp32 is non-finite there too)."""
    value, new = 0.0, False
    for a, b in zip(tree_leaves(low), tree_leaves(wide)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()):
            continue
        bad = ~torch.isfinite(a)
        if b.shape != a.shape:
            new = new or bool(bad.any())
            continue
        fresh = bad & torch.isfinite(b)
        if bool(fresh.any()):
            new = True
            value = max(value, float(b[fresh].abs().max()))
        elif bool((bad & torch.isnan(a) & ~torch.isnan(b)).any()):
            new, value = True, float("inf")
    return value, new


@dataclass
class Record:
    """What the hooks saw in one pass."""

    forward_first: tuple[str, str, float] | None = None  # module, tensor, fp32 value
    backward_first: tuple[str, str] | None = None
    grad_absmax: dict[str, float] = field(default_factory=dict)  # module -> max |output gradient|
    grad_in_absmax: dict[str, float] = field(default_factory=dict)  # module -> max |input gradient|
    backward_order: list[str] = field(default_factory=list)  # leaf modules in backward (hook) order
    backward_on: bool = False
    wide: bool = False  # an fp32 pass: blame the first NaN made from NaN-free inputs instead
    busy: bool = False  # inside a recomputation: the hooks stay quiet


@contextlib.contextmanager
def _hooks(model: torch.nn.Module, rec: Record, device_type: str) -> Iterator[None]:
    """Forward hooks on every module and full backward hooks on every leaf module, feeding ``rec``."""
    handles = []
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

    def forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        if rec.forward_first is not None or rec.busy:
            return
        if rec.wide:
            if _has_nan(output) and not _has_nan(args):
                name = names[id(module)]
                rec.forward_first = (name, f"{name} output", float("nan"))
            return
        if _finite(output) or not _finite(args):
            return
        # Candidate: finite inputs, non-finite output. Recompute it in fp32 from the same inputs;
        # intentional infinities (a -inf attention mask) are there in fp32 too and do not count.
        name = names[id(module)]
        rec.busy = True
        try:
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                wide = module(*[a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                for a in args])
        except Exception:  # noqa: BLE001 - a module that cannot be re-called: blame it, value unknown
            rec.forward_first = (name, f"{name} output", float("inf"))
            return
        finally:
            rec.busy = False
        value, new = _out_of_range(output, wide)
        if new:
            rec.forward_first = (name, f"{name} output", value)

    def backward(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        if not rec.backward_on:
            return
        name = names[id(module)]
        rec.grad_absmax[name] = max(rec.grad_absmax.get(name, 0.0), _absmax(grad_output))
        rec.grad_in_absmax[name] = max(rec.grad_in_absmax.get(name, 0.0), _absmax(grad_input))
        rec.backward_order.append(name)
        if rec.backward_first is None and _finite(grad_output) and not _finite(grad_input):
            rec.backward_first = (name, f"gradient of {name}'s input")

    try:
        for m in model.modules():
            handles.append(m.register_forward_hook(forward))
            if not list(m.children()):
                handles.append(m.register_full_backward_hook(backward))
        with warnings.catch_warnings():  # the first layer's inputs need no gradient: expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        for h in handles:
            h.remove()


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


def _first_backward(model: torch.nn.Module, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
                    rec: Record) -> tuple[str, str] | None:
    """The first module, in backward order, whose input gradient or parameter gradient is non-finite."""
    bad = {id(p) for p, g in zip(params, grads) if not bool(torch.isfinite(g).all())}
    owners = list(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n, p in model.named_parameters()
                                if id(p) in bad))
    order = {n: i for i, n in reversed(list(enumerate(rec.backward_order)))}
    found: list[tuple[int, str, str]] = [(order.get(m, len(order)), m, f"{m} parameter gradient") for m in owners]
    if rec.backward_first is not None:
        found.append((order.get(rec.backward_first[0], len(order)), *rec.backward_first))
    if not found:
        return None
    _, module, tensor = min(found)
    return module, tensor


class _NoStep(torch.optim.Optimizer):
    """An optimizer whose ``step`` changes nothing: strategies drive it as they would any other."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _hooks_forward(strat: Any) -> bool:
    """Does ``strat.attach`` hook the forward pass (layer boundaries: ``layerwise``,
    ``underflow_target``)? The reference-probe rules' ``attach`` only remembers parameters."""
    return type(strat).attach is not strategies.Strategy.attach and not isinstance(strat, ReferenceProbe)


def _strategy_scales(names: Sequence[str], loss: torch.Tensor, params: list[torch.nn.Parameter],
                     model: torch.nn.Module, reference: Callable[[], torch.Tensor],
                     fresh: Callable[[], torch.Tensor] | None) -> tuple[dict[str, float], dict[str, str], int]:
    """The scale each strategy chooses after one step on this gradient (its own scale, unscale_,
    step and update; the optimizer's step does nothing, so no parameter moves, nor does its
    version counter: the retained graph stays usable). A strategy that hooks the forward pass
    needs a forward of its own, with it attached: ``fresh()`` (``None``: such strategies are not
    compared). Returns the scales, the strategies not compared (why), and the fresh forwards run."""
    chosen: dict[str, float] = {}
    skipped: dict[str, str] = {}
    forwards = 0
    for name in names:
        strat = strategies.create(name)
        hooks = _hooks_forward(strat)
        if hooks and fresh is None:
            skipped[name] = "hooks the forward pass: compared with forward_strategies=True (one more forward each)"
            continue
        strat.set_reference(reference, params)
        strat.attach(model)
        saved = [p.grad for p in params]
        try:
            own = loss
            if hooks:
                own = fresh()
                forwards += 1
            grads = torch.autograd.grad(strat.scale(own), params, retain_graph=True, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.to(p.dtype)
            strat.step(_NoStep(params))
            strat.update()
            chosen[name] = float(strat.get_scale())
        except (RuntimeError, ValueError) as exc:
            skipped[name] = " ".join(str(exc).split())[:160]
        finally:
            strat.detach()
            for p, g in zip(params, saved):
                p.grad = g
    return chosen, skipped, forwards


def backward_value(first: tuple[str, str], model: torch.nn.Module, params: list[torch.nn.Parameter],
                    ref: list[torch.Tensor], ref_rec: Record, scale: float) -> float | None:
    """The magnitude the overflowing tensor needed: its fp32 abs-max times ``scale``."""
    module, tensor = first
    if tensor.endswith("parameter gradient"):
        mine = {id(p) for p in model.get_submodule(module).parameters(recurse=False)} if module else set()
        vals = [float(r.abs().max()) for p, r in zip(params, ref) if id(p) in mine and r.numel()]
        return max(vals) * scale if vals else None
    value = ref_rec.grad_in_absmax.get(module)
    return None if value is None else value * scale


def safe_scale(fmax: float, ref_rec: Record, ref: list[torch.Tensor]) -> float:
    """The largest scale at which no fp32 activation or parameter gradient would leave the range:
    ``fmax / max(|g|)`` (``inf`` for an all-zero gradient)."""
    peak = max([*ref_rec.grad_absmax.values(), *(float(r.abs().max()) for r in ref if r.numel())], default=0.0)
    return fmax / peak if peak > 0 else float("inf")


@dataclass
class Measured:
    """Everything the passes measured; :func:`_decide` turns it into a :class:`Diagnosis`."""

    precision: str
    scale: float
    fmax: float
    bad_inputs: list[str]  # non-finite batch tensors or parameters
    prior_norm: float  # ||.grad|| the step started with
    ref: list[torch.Tensor]  # the fp32 gradient
    ref_norm: float
    ref_loss: float
    ref_rec: Record
    rec: Record
    fp32_finite: bool
    fwd_finite: bool
    grads_finite: bool
    at_one_finite: bool
    back_first: tuple[str, str] | None
    per_layer: list[LayerDamage]
    chosen: dict[str, float]
    skipped: dict[str, str]
    passes: dict[str, int]


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


def measure(model: torch.nn.Module, loss_fn: LossFn, batch: Any, params: list[torch.nn.Parameter],
             precision: str, S: float, dev: str, compare_strategies: bool,
             strategy_names: Sequence[str] | None, forward_strategies: bool) -> Measured:
    """The fp32 pass, then the mixed pass (module docstring), with the model left as it was."""
    names, index = _layer_index(model, params)
    passes = {"forward": 0, "backward": 0}
    prior_norm = _norm([p.grad for p in params])
    bad_inputs = _bad_inputs(model, batch)
    grads_finite, at_one_finite = False, True
    back_first: tuple[str, str] | None = None
    chosen: dict[str, float] = {}
    skipped: dict[str, str] = {}
    per_layer: list[LayerDamage] = []
    device = params[0].device
    with _preserved(model, device):
        rng = capture_rng(device)
        # fp32: the reference gradient and the activation-gradient magnitudes.
        ref_rec = Record(backward_on=True, wide=True)
        with _hooks(model, ref_rec, dev), torch.autocast(dev, enabled=False), torch.enable_grad():
            ref_loss = loss_fn(model, batch).float()
            passes["forward"] += 1
            fp32_finite = bool(torch.isfinite(ref_loss).all())
            ref = _backward(ref_loss, params, 1.0) if fp32_finite else [torch.zeros_like(p) for p in params]
            passes["backward"] += int(fp32_finite)
        # mixed: forward under autocast, backward at S, and at 1 when S overflows (same graph).
        restore_rng(rng, device)
        rec = Record()
        with _hooks(model, rec, dev), torch.enable_grad():
            with torch.autocast(dev, dtype=DTYPES[precision]):
                loss = loss_fn(model, batch)
            passes["forward"] += 1
            loss = loss.float()
            fwd_finite = bool(torch.isfinite(loss).all())
            if fwd_finite:
                rec.backward_on = True
                grads = _backward(loss, params, S)
                passes["backward"] += 1
                rec.backward_on = False
                grads_finite = _all_finite(grads)
                if fp32_finite:
                    per_layer = _damage(grads, ref, S, names, index)
                if not grads_finite:
                    back_first = _first_backward(model, params, grads, rec)
                    at_one_finite = _all_finite(_backward(loss, params, 1.0))
                    passes["backward"] += 1
                if compare_strategies and fp32_finite:
                    def reference() -> torch.Tensor:
                        with torch.autocast(dev, enabled=False):
                            return loss_fn(model, batch).float()

                    def fresh() -> torch.Tensor:
                        restore_rng(rng, device)
                        with torch.autocast(dev, dtype=DTYPES[precision]):
                            return loss_fn(model, batch).float()
                    chosen, skipped, forwards = _strategy_scales(
                        strategy_names or strategies.available(), loss, params, model, reference,
                        fresh if forward_strategies else None)
                    passes["forward"] += forwards
                    passes["backward"] += len(chosen)
                    bound = safe_scale(float(torch.finfo(DTYPES[precision]).max), ref_rec, ref)
                    candidates = set(chosen.values())
                    if math.isfinite(bound) and bound >= 2.0:
                        candidates.add(2.0 ** math.floor(math.log2(bound / 2)))  # the largest pow2 with 2x headroom
                    for s in sorted(candidates - {S}):
                        per_layer += _damage(_backward(loss, params, s), ref, s, names, index)
                        passes["backward"] += 1
    return Measured(precision, S, float(torch.finfo(DTYPES[precision]).max), bad_inputs, prior_norm, ref,
                     _norm(ref), float(ref_loss.detach()), ref_rec, rec, fp32_finite, fwd_finite, grads_finite,
                     at_one_finite, back_first, per_layer, chosen, skipped, passes)
