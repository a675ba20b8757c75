"""Why does the loss scale collapse, and what would fix it? One step, diagnosed.

``diagnose(model, loss_fn, batch, precision="fp16", scaler=None)`` re-runs one training step
of the user's own model on the user's own batch and returns a :class:`Diagnosis`. It needs no
training loop: ``loss_fn(model, batch)`` must return the scalar loss (the forward included).

Passes (the model's weights, ``.grad``, buffers and RNG state are left as they were):

1. **mixed**: forward under ``torch.autocast(dtype=fp16|bf16)`` with a forward hook on every
   module, then backward of ``loss * S`` (``S`` = the scaler's scale, else 2^16, the
   ``GradScaler`` default) with full backward hooks; when that backward overflows, a second
   backward of ``loss * 1`` through the same graph tells whether the overflow is
   *scale-independent*;
2. **fp32**: forward and backward with autocast off: the reference gradient ``r`` and the fp32
   activation-gradient abs-max of each module.

So two forward+backward passes by default; ``compare_strategies=True`` (the default) adds
backward passes only (through the retained mixed graph): one per registered strategy to see the
scale it would choose from this gradient, one per distinct such scale to measure its damage.
Strategies that hook the forward pass (``layerwise``, ``underflow_target``) need a forward of
their own: with ``forward_strategies=True`` they get one each, else they are listed as not
compared. The damage at a scale is measured with one loss scale for the whole model (for
``layerwise``, its loss-side scale: the per-layer rescaling is not replayed).

**First module out of range.** Forward: the first module, in completion order, whose inputs
are finite and whose output is not (inner modules complete first, so this is the innermost
culprit); its fp32 value is recomputed from the same inputs (one module call). Backward: the
first module, in backward order, whose output gradient is finite and whose input gradient is
not (full backward hooks); if no activation gradient overflows, the first module owning a
non-finite parameter gradient.

**Underflow damage** per layer (``strategies.boundaries.layers``) of the unscaled mixed
gradient ``g`` against ``r``: ``lost = #{r != 0, g == 0} / #{r != 0}`` and
``cosine = <g, r> / (||g|| ||r||)`` — the same definitions as the app's fidelity probe.

**Decision list** (the first check that holds is the cause):

1. ``nan_in_data_or_loss`` — a floating tensor of the batch (or a parameter: an earlier step
   already wrote NaN into the weights) holds NaN/Inf, or the fp32 forward itself is non-finite
   (the loss, not the format, is broken);
2. ``grads_not_cleared`` — the parameters held gradients before the step whose norm is at least
   ``2x`` this step's fp32 gradient norm (accumulated over steps: ``zero_grad`` missing), or
   non-finite ones (an earlier overflow left in ``.grad``: every later step overflows too);
3. ``lr_spike`` — the step overflows (forward or backward) and the last learning rate of
   ``lr_history`` (at least three rates) is at least ``2x`` the largest of the earlier ones (a
   jump); or the overflow is scale-independent (forward, or backward at ``S = 1`` too) and the
   last rate is the window's peak and at least ``2x`` its smallest (a loss spike at the peak of
   a short warmup to a high learning rate; the scaler's own probing during a warmup is not one);
4. ``forward_overflow`` — the mixed forward is non-finite while the fp32 forward is finite
   (no loss scale can help: the scale acts on the backward only);
5. ``gradient_overflow`` — the backward overflows at ``S`` *and* at ``S = 1``: genuine
   gradient overflow, independent of the scale;
6. ``scale_overflow`` — the backward overflows at ``S`` only: the scaler's normal probing, it
   backs off (benign unless it repeats at every scale);
7. ``underflow`` — some layer loses at least ``underflow_threshold`` (1%) of its nonzero
   gradient entries, or its cosine to fp32 is below 0.99;
8. ``healthy`` — none of the above.

Sources: the T5 fp16 forward overflow (the FFN output ``wo`` exceeds 65504; HF transformers
issue #9295 and ``_keep_in_fp32_modules``), attention-logit growth (Wortsman et al. 2023,
"Small-scale proxies for large-scale Transformer training instabilities": QK-layernorm),
HF's ``DebugUnderflowOverflow`` (forward hooks, first module with inf/nan), and the loss-scaling
recipe of Micikevicius et al. 2018.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from strategies.doctor.passes import (DTYPES, LayerDamage, LossFn, Measured, backward_value, measure,
                                      safe_scale)
from strategies.state import ScaleFloorError

__all__ = ["CAUSES", "EXIT_CODES", "Diagnosis", "LayerDamage", "diagnose"]

CAUSES = (
    "healthy",
    "scale_overflow",
    "forward_overflow",
    "nan_in_data_or_loss",
    "grads_not_cleared",
    "lr_spike",
    "gradient_overflow",
    "underflow",
)
"""Every verdict class, in the order of their exit codes."""

EXIT_CODES = {
    "healthy": 0,
    "scale_overflow": 1,
    # 2 is left to command-line errors (argparse's usage code).
    "forward_overflow": 3,
    "nan_in_data_or_loss": 4,
    "grads_not_cleared": 5,
    "lr_spike": 6,
    "gradient_overflow": 7,
    "underflow": 8,
}
"""Exit code of ``scalelab-doctor`` per cause (2: the run directory or the command line is bad)."""

DEFAULT_SCALE = 2.0**16
ACCUMULATED_RATIO = 2.0
LR_SPIKE_RATIO = 2.0
ATTENTION_WORDS = ("attn", "attention", "qk", "logit", "score")


@dataclass
class Diagnosis:
    """The doctor's verdict on one step (see the module docstring for the decision list)."""

    cause: str
    verdict: str
    fix: str
    precision: str
    scale: float
    first_module: str | None = None
    tensor: str | None = None
    value: float | None = None
    evidence: list[str] = field(default_factory=list)
    per_layer: list[LayerDamage] = field(default_factory=list)
    strategy_scales: dict[str, float] = field(default_factory=dict)
    not_compared: dict[str, str] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.cause]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["exit_code"] = self.exit_code
        return out

    def to_json_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with non-finite numbers as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
        return _finite_json(self.to_dict())

    def to_json(self) -> str:
        """JSON text of :meth:`to_json_dict`."""
        return json.dumps(self.to_json_dict(), indent=2)

    def one_line(self) -> str:
        """The verdict in one line, e.g. for an error message: ``cause at module: verdict; fix: ...``."""
        where = f" at {self.first_module}" if self.first_module else ""
        return f"doctor: {self.cause}{where}: {self.verdict}; fix: {self.fix}"

    def table(self) -> str:
        """The per-layer damage as fixed-width text: one row per layer, one column pair per scale."""
        scales = sorted({d.scale for d in self.per_layer})
        names = list(dict.fromkeys(d.layer for d in self.per_layer))
        if not names:
            return ""
        cell = {(d.layer, d.scale): d for d in self.per_layer}
        width = max(len(n) for n in names + ["layer"])
        head = f"{'layer':<{width}}" + "".join(f"  {'S=' + _num(s) + ' lost/cos':>22}" for s in scales)
        rows = [head]
        for n in names:
            parts = []
            for s in scales:
                d = cell.get((n, s))
                parts.append(f"  {'-':>22}" if d is None else f"  {_pct(d.lost_frac) + ' / ' + _cos(d):>22}")
            rows.append(f"{n:<{width}}" + "".join(parts))
        return "\n".join(rows)

    def text(self) -> str:
        """The verdict readable at a glance: cause, where, value, fix, evidence, damage table."""
        lines = [f"verdict: {self.cause.upper()} — {self.verdict}"]
        if self.first_module is not None:
            where = f"{self.first_module}" + (f" ({self.tensor})" if self.tensor else "")
            lines.append(f"where:   {where}" + (f", value {_num(self.value)}" if self.value is not None else ""))
        lines.append(f"fix:     {self.fix}")
        lines += [f"  - {e}" for e in self.evidence]
        if self.strategy_scales:
            lines.append("scales the strategies would choose: "
                         + ", ".join(f"{k}={_num(v)}" for k, v in sorted(self.strategy_scales.items())))
        table = self.table()
        if table:
            lines += ["per-layer underflow (lost nonzero entries / cosine vs fp32):", table]
        return "\n".join(lines)


def _finite_json(node: Any) -> Any:
    if isinstance(node, float) and not math.isfinite(node):
        return str(node)
    if isinstance(node, dict):
        return {k: _finite_json(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite_json(v) for v in node]
    return node


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _cos(d: LayerDamage) -> str:
    return "inf" if d.found_inf else ("nan" if d.cosine != d.cosine else f"{d.cosine:.4f}")


def _current_scale(scaler: Any) -> float:
    """The scaler's scale; a strategy that stopped at its floor (``on_min_scale: raise``) raises
    from ``get_scale()``, and its scale is then the floor it stopped at."""
    try:
        return float(scaler.get_scale())
    except ScaleFloorError:
        return float(scaler.output_scale())


def _lr_spike(lr_history: Sequence[float] | None, scale_independent: bool) -> tuple[float, str] | None:
    """``(ratio, "largest")`` when ``lr_now / max(earlier)`` is at least :data:`LR_SPIKE_RATIO` (a
    jump); for a ``scale_independent`` overflow also ``(ratio, "smallest")`` when ``lr_now`` is the
    window's peak and ``lr_now / min(earlier)`` is at least that (a fast rise to the peak). At least
    three rates: an overflow at the second step (e.g. from the initial weights) is never a spike,
    nor, through the jump rule, a linear warmup (its step-to-step ratio is below 2 from step 3)."""
    if not lr_history or len(lr_history) < 3:
        return None
    now, earlier = float(lr_history[-1]), [float(v) for v in lr_history[:-1]]
    for ref, word in ((max(earlier), "largest"), (min(earlier), "smallest")):
        if word == "smallest" and (not scale_independent or now < max(earlier)):
            break
        ratio = now / ref if ref > 0 else float("inf")
        if ratio >= LR_SPIKE_RATIO:
            return ratio, word
    return None


def _is_attention(name: str) -> bool:
    return any(w in name.lower() for w in ATTENTION_WORDS)


def diagnose(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    precision: str = "fp16",
    scaler: Any = None,
    *,
    scale: float | None = None,
    lr_history: Sequence[float] | None = None,
    compare_strategies: bool = True,
    strategy_names: Sequence[str] | None = None,
    forward_strategies: bool = False,
    underflow_threshold: float = 0.01,
    device_type: str | None = None,
) -> Diagnosis:
    """Diagnose one step of ``model`` on ``batch`` (see the module docstring for the method).

    Args:
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (runs the forward).
        precision: ``"fp16"`` or ``"bf16"`` (``torch.autocast``).
        scaler: a ``GradScaler``-like object; its ``get_scale()`` is the current scale ``S``.
        scale: ``S`` when no scaler is given (default 2^16, GradScaler's initial scale).
        lr_history: learning rates of the recent steps, the current one last (for ``lr_spike``).
        compare_strategies: also measure the scale each registered strategy would choose.
        strategy_names: which strategies to compare (default: every registered one).
        forward_strategies: also compare the strategies that hook the forward pass (``layerwise``,
            ``underflow_target``): one more forward+backward each.
        underflow_threshold: lost fraction of a layer's nonzero entries that counts as damage.
    """
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    if not 0.0 < underflow_threshold < 1.0:
        raise ValueError(f"underflow_threshold must be in (0, 1), got {underflow_threshold}")
    S = _current_scale(scaler) if scaler is not None else float(scale if scale is not None else DEFAULT_SCALE)
    if not (math.isfinite(S) and S > 0):
        raise ValueError(f"scale must be finite and > 0, got {S}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameter that requires grad")
    m = measure(model, loss_fn, batch, params, precision, S, device_type or params[0].device.type,
                 compare_strategies, strategy_names, forward_strategies)
    return _decide(m, model, params, lr_history, underflow_threshold)


def _decide(m: Measured, model: torch.nn.Module, params: list[torch.nn.Parameter],
            lr_history: Sequence[float] | None, underflow_threshold: float) -> Diagnosis:
    """The decision list of the module docstring, in order; the first check that holds is the cause."""
    precision, S, fmax = m.precision, m.scale, m.fmax
    diag = Diagnosis(cause="healthy", verdict="", fix="", precision=precision, scale=S, per_layer=m.per_layer,
                     strategy_scales=m.chosen, not_compared=m.skipped, passes=m.passes)
    evidence = diag.evidence
    overflow = not m.fwd_finite or not m.grads_finite
    spike = _lr_spike(lr_history, not m.fwd_finite or (not m.grads_finite and not m.at_one_finite))
    safe = safe_scale(fmax, m.ref_rec, m.ref)

    # 1. NaN/Inf in the data, the weights or the loss itself.
    if m.bad_inputs or not m.fp32_finite:
        diag.cause = "nan_in_data_or_loss"
        evidence += m.bad_inputs
        if m.ref_rec.forward_first is not None:
            diag.first_module, diag.tensor, diag.value = m.ref_rec.forward_first
        if not m.fp32_finite:
            evidence.append(f"the fp32 loss is {m.ref_loss:g}: no precision or scale makes this step finite")
        diag.verdict = "the batch, the weights or the loss is non-finite before any low-precision arithmetic"
        diag.fix = ("drop or repair the batch (check the data pipeline for NaN/Inf), guard the loss "
                    "(e.g. log(x + eps)); skip such batches instead of letting the scaler back off")
    # 2. Gradients accumulated over steps.
    elif not math.isfinite(m.prior_norm) or (
            m.prior_norm > 0 and m.ref_norm > 0 and m.prior_norm >= ACCUMULATED_RATIO * m.ref_norm):
        diag.cause = "grads_not_cleared"
        if math.isfinite(m.prior_norm):
            evidence.append(f"the parameters already held gradients of norm {m.prior_norm:.4g} before this step, "
                            f"{m.prior_norm / m.ref_norm:.1f}x this step's fp32 gradient norm {m.ref_norm:.4g}")
        else:
            evidence.append(f"the parameters already held non-finite gradients before this step (norm {m.prior_norm:g}): "
                            "an earlier overflow stayed in .grad, so every later step overflows and is skipped, "
                            "and the scale falls to its floor whatever it is")
        diag.verdict = "gradients are accumulating across steps: .grad was never cleared"
        diag.fix = "call optimizer.zero_grad(set_to_none=True) after every optimizer step (or every accumulation window)"
    # 3. A learning-rate spike that made the step overflow.
    elif overflow and spike is not None:
        assert lr_history is not None
        diag.cause = "lr_spike"
        first = m.rec.forward_first if not m.fwd_finite else m.back_first
        if first is not None:
            diag.first_module, diag.tensor = first[0], first[1]
        evidence.append(f"learning rate {lr_history[-1]:g} is {spike[0]:.1f}x the {spike[1]} of the previous "
                        f"{len(lr_history) - 1} steps, and this step overflows in the "
                        f"{'forward' if not m.fwd_finite else 'backward'} pass")
        diag.verdict = ("the step overflows right after a learning-rate spike" if spike[1] == "largest" else
                        "the step overflows at the peak of a fast learning-rate rise (a loss spike at the LR peak)")
        diag.fix = "lower the peak learning rate or lengthen the warmup; add gradient clipping"
    # 4. Forward overflow: scale-independent by construction.
    elif not m.fwd_finite:
        diag.cause = "forward_overflow"
        if m.rec.forward_first is not None:
            diag.first_module, diag.tensor, diag.value = m.rec.forward_first
        name = diag.first_module or "the first overflowing module"
        evidence.append(f"the {precision} forward is non-finite, the fp32 forward is finite (loss {m.ref_loss:.4g})")
        if diag.value is not None and math.isfinite(diag.value) and diag.value > fmax:
            evidence.append(f"{name} outputs {diag.value:.6g} in fp32, above the {precision} maximum {fmax:.6g}")
        elif diag.value is not None and math.isfinite(diag.value):
            evidence.append(f"{name} outputs at most {diag.value:.6g} in fp32, but an intermediate inside it "
                            f"(e.g. a product before its scaling) exceeds the {precision} maximum {fmax:.6g}")
        evidence.append("the loss scale multiplies the backward only: every scaler skips this step at every scale")
        diag.verdict = f"forward overflow in {precision} at {name}: no loss scale can fix it"
        diag.fix = (f"keep {name} in fp32 (run its forward under torch.autocast(..., enabled=False) on a .float() "
                    "input, as HF keeps T5's `wo` via _keep_in_fp32_modules), or train in bf16")
        if _is_attention(name):
            diag.fix += "; attention logits grow: add QK-norm (LayerNorm on q and k, Wortsman et al. 2023) or lower the LR"
    # 5. Gradient overflow at S = 1 too; 6. overflow only at this scale (the scaler's own probing).
    elif not m.grads_finite:
        genuine = not m.at_one_finite
        diag.cause = "gradient_overflow" if genuine else "scale_overflow"
        if m.back_first is not None:
            diag.first_module, diag.tensor = m.back_first
            diag.value = backward_value(m.back_first, model, params, m.ref, m.ref_rec, 1.0 if genuine else S)
        name = diag.first_module or "the overflowing module"
        if genuine:
            evidence.append(f"the backward overflows at S={S:g} and at S=1: the gradient itself exceeds {precision}'s range")
            diag.verdict = f"gradient overflow at {name}, independent of the loss scale"
            diag.fix = f"keep {name} in fp32 (autocast exclusion), or train in bf16; clip or lower the LR if it grew recently"
        else:
            evidence.append(f"the backward overflows at S={S:g} but not at S=1; the largest safe scale is about "
                            f"{safe:.4g} ({precision} max / fp32 gradient abs-max)")
            diag.verdict = f"the scale {S:g} is too high for this step; the scaler backs off (normal probing)"
            diag.fix = ("nothing, unless it repeats every step: then a scaler that targets the abs-max "
                        "(strategy=max_ema or amax_history) instead of probing")
    # 7. Underflow damage at the current scale; 8. healthy.
    else:
        damaged = [d for d in m.per_layer if d.scale == S and (d.lost_frac >= underflow_threshold or d.cosine < 0.99)]
        if damaged:
            diag.cause = "underflow"
            worst = max(damaged, key=lambda d: d.lost_frac)
            diag.first_module, diag.tensor, diag.value = worst.layer, f"{worst.layer} parameter gradient", worst.lost_frac
            evidence.append(f"at S={S:g}, {worst.layer} loses {_pct(worst.lost_frac)} of its nonzero gradient "
                            f"entries (cosine {_cos(worst)})")
            best = _best_scale(m.per_layer, S)
            diag.verdict = f"{precision} gradients underflow at S={S:g}: {len(damaged)} layer(s) lose gradient"
            if best is not None and best != S:
                who = sorted(k for k, v in m.chosen.items() if v == best)
                lost = max(d.lost_frac for d in m.per_layer if d.scale == best)
                by = f"chosen by {', '.join(who)}" if who else f"2x below the overflow bound {safe:.4g}"
                evidence.append(f"at S={best:.4g} ({by}) the worst layer loses {_pct(lost)}")
                diag.fix = (f"the scale {best:.4g}: strategy={who[0]}, or bf16" if who else
                            f"a scale near {best:.4g} (strategy=underflow_target or amax_history, which place S "
                            "from the gradient's range), or bf16")
            else:
                diag.fix = (f"raise the scale toward the safe {safe:.4g} (strategy=underflow_target or max_ema), "
                            "or train in bf16")
        else:
            diag.verdict = f"no overflow, no underflow damage above {_pct(underflow_threshold)} at S={S:g}"
            diag.fix = "nothing to fix for this step"
    return diag


def _best_scale(per_layer: list[LayerDamage], current: float) -> float | None:
    """The finite-gradient scale whose worst layer loses the least (ties: the current scale)."""
    by_scale: dict[float, float] = {}
    for d in per_layer:
        worst = float("inf") if d.found_inf else d.lost_frac
        by_scale[d.scale] = max(by_scale.get(d.scale, 0.0), worst)
    finite = {s: v for s, v in by_scale.items() if math.isfinite(v)}
    if not finite:
        return None
    return min(finite, key=lambda s: (finite[s], s != current))
