"""The doctor's decision list, as data: :data:`DECISIONS`, an ordered tuple of :class:`Decision`
(a condition on the measured step, the cause it names, how it explains itself), evaluated in
order by :func:`decide` — the first that holds is the cause. :func:`decision_list` renders the
list as numbered text for the doctor's docstring and ``docs/doctor.md``.

Each decision's explanation (verdict, fix, evidence) cites its sources where a fix comes from one;
the method and the sources of the doctor as a whole: :mod:`strategies.doctor`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from strategies.doctor.block_clip import BlockClip, recipe_label, scale_fix
from strategies.doctor.measure import Measured
from strategies.doctor.passes import backward_value, safe_scale
from strategies.doctor.verdict import Diagnosis, LayerDamage, cos_text, pct

__all__ = ["ACCUMULATED_RATIO", "BLOCK_CLIP_THRESHOLD", "ATTENTION_WORDS", "DECISIONS", "LR_SPIKE_RATIO", "Decision", "Facts", "decide",
           "decision_list"]

ACCUMULATED_RATIO = 2.0
LR_SPIKE_RATIO = 2.0
ATTENTION_WORDS = ("attn", "attention", "qk", "logit", "score")
BLOCK_CLIP_THRESHOLD = 0.1
"""Share of one role's blocks in one Linear whose max element a block-scaled cast changes by saturating,
from which the doctor calls it damage: a choice of this project (no source gives one; AMD's ~37%
of MXFP4 blocks, ROCm/aiter PR 3212, and MXFP8 FLOOR's ~19% expected for a log-uniform mantissa lie
above it, a scale rounded up clips none)."""


@dataclass(frozen=True)
class Facts:
    """What the decisions read: the measured step and what follows from it."""

    m: Measured
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    lr_history: Sequence[float] | None
    underflow_threshold: float
    spike: tuple[float, str] | None  # (ratio, "largest" | "smallest"): see _lr_spike
    safe: float  # the largest scale at which no fp32 gradient leaves the range
    damaged: list[LayerDamage]  # the layers damaged by underflow at the current scale
    clipping: list[BlockClip] = dataclasses.field(default_factory=list)  # above the threshold, worst first

    @property
    def overflow(self) -> bool:
        return not self.m.fwd_finite or not self.m.grads_finite


@dataclass(frozen=True)
class Decision:
    """One entry of the decision list: ``cause`` when ``holds(facts)``; ``explain(facts, diag)``
    fills in the verdict, fix, evidence and first module; ``doc`` is the entry's text."""

    cause: str
    holds: Callable[[Facts], bool]
    explain: Callable[[Facts, Diagnosis], None]
    doc: str


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


def _nan_in_data_or_loss(f: Facts, diag: Diagnosis) -> None:
    m = f.m
    diag.evidence += m.bad_inputs
    if m.ref_rec.forward_first is not None:
        diag.first_module, diag.tensor, diag.value = m.ref_rec.forward_first
    if not m.fp32_finite:
        diag.evidence.append(f"the fp32 loss is {m.ref_loss:g}: no precision or scale makes this step finite")
    diag.verdict = "the batch, the weights or the loss is non-finite before any low-precision arithmetic"
    diag.fix = ("drop or repair the batch (check the data pipeline for NaN/Inf), guard the loss "
                "(e.g. log(x + eps)); skip such batches instead of letting the scaler back off")


def _accumulated(f: Facts) -> bool:
    prior, ref = f.m.prior_norm, f.m.ref_norm
    return not math.isfinite(prior) or (prior > 0 and ref > 0 and prior >= ACCUMULATED_RATIO * ref)


def _grads_not_cleared(f: Facts, diag: Diagnosis) -> None:
    m = f.m
    if math.isfinite(m.prior_norm):
        diag.evidence.append(f"the parameters already held gradients of norm {m.prior_norm:.4g} before this step, "
                             f"{m.prior_norm / m.ref_norm:.1f}x this step's fp32 gradient norm {m.ref_norm:.4g}")
    else:
        diag.evidence.append(f"the parameters already held non-finite gradients before this step (norm {m.prior_norm:g}): "
                             "an earlier overflow stayed in .grad, so every later step overflows and is skipped, "
                             "and the scale falls to its floor whatever it is")
    diag.verdict = "gradients are accumulating across steps: .grad was never cleared"
    diag.fix = "call optimizer.zero_grad(set_to_none=True) after every optimizer step (or every accumulation window)"


def _lr_spike_found(f: Facts, diag: Diagnosis) -> None:
    m, spike, lr_history = f.m, f.spike, f.lr_history
    assert spike is not None and lr_history is not None
    first = m.rec.forward_first if not m.fwd_finite else m.back_first
    if first is not None:
        diag.first_module, diag.tensor = first[0], first[1]
    diag.evidence.append(f"learning rate {lr_history[-1]:g} is {spike[0]:.1f}x the {spike[1]} of the previous "
                         f"{len(lr_history) - 1} steps, and this step overflows in the "
                         f"{'forward' if not m.fwd_finite else 'backward'} pass")
    diag.verdict = ("the step overflows right after a learning-rate spike" if spike[1] == "largest" else
                    "the step overflows at the peak of a fast learning-rate rise (a loss spike at the LR peak)")
    diag.fix = "lower the peak learning rate or lengthen the warmup; add gradient clipping"


def _forward_overflow(f: Facts, diag: Diagnosis) -> None:
    m, precision, fmax = f.m, f.m.precision, f.m.fmax
    if m.rec.forward_first is not None:
        diag.first_module, diag.tensor, diag.value = m.rec.forward_first
    name = diag.first_module or "the first overflowing module"
    diag.evidence.append(f"the {precision} forward is non-finite, the fp32 forward is finite (loss {m.ref_loss:.4g})")
    if diag.value is not None and math.isfinite(diag.value) and diag.value > fmax:
        diag.evidence.append(f"{name} outputs {diag.value:.6g} in fp32, above the {precision} maximum {fmax:.6g}")
    elif diag.value is not None and math.isfinite(diag.value):
        diag.evidence.append(f"{name} outputs at most {diag.value:.6g} in fp32, but an intermediate inside it "
                             f"(e.g. a product before its scaling) exceeds the {precision} maximum {fmax:.6g}")
    diag.evidence.append("the loss scale multiplies the backward only: every scaler skips this step at every scale")
    diag.verdict = f"forward overflow in {precision} at {name}: no loss scale can fix it"
    diag.fix = (f"keep {name} in fp32 (run its forward under torch.autocast(..., enabled=False) on a .float() "
                "input, as HF keeps T5's `wo` via _keep_in_fp32_modules), or train in bf16")
    if _is_attention(name):
        diag.fix += "; attention logits grow: add QK-norm (LayerNorm on q and k, Wortsman et al. 2023) or lower the LR"


def _backward_first(f: Facts, diag: Diagnosis, scale: float) -> str:
    """Set the first module of a backward overflow and the magnitude it needed at ``scale``; its name."""
    m = f.m
    if m.back_first is not None:
        diag.first_module, diag.tensor = m.back_first
        diag.value = backward_value(m.back_first, f.model, f.params, m.ref, m.ref_rec, scale)
    return diag.first_module or "the overflowing module"


def _gradient_overflow(f: Facts, diag: Diagnosis) -> None:
    name = _backward_first(f, diag, 1.0)
    diag.evidence.append(f"the backward overflows at S={f.m.scale:g} and at S=1: the gradient itself exceeds "
                         f"{f.m.precision}'s range")
    diag.verdict = f"gradient overflow at {name}, independent of the loss scale"
    diag.fix = f"keep {name} in fp32 (autocast exclusion), or train in bf16; clip or lower the LR if it grew recently"


def _scale_overflow(f: Facts, diag: Diagnosis) -> None:
    S = f.m.scale
    _backward_first(f, diag, S)
    diag.evidence.append(f"the backward overflows at S={S:g} but not at S=1; the largest safe scale is about "
                         f"{f.safe:.4g} ({f.m.precision} max / fp32 gradient abs-max)")
    diag.verdict = f"the scale {S:g} is too high for this step; the scaler backs off (normal probing)"
    diag.fix = ("nothing, unless it repeats every step: then a scaler that targets the abs-max "
                "(strategy=max_ema or amax_history) instead of probing")


def _underflow(f: Facts, diag: Diagnosis) -> None:
    m, S = f.m, f.m.scale
    worst = max(f.damaged, key=lambda d: d.lost_frac)
    diag.first_module, diag.tensor, diag.value = worst.layer, f"{worst.layer} parameter gradient", worst.lost_frac
    diag.evidence.append(f"at S={S:g}, {worst.layer} loses {pct(worst.lost_frac)} of its nonzero gradient "
                         f"entries (cosine {cos_text(worst)})")
    best = _best_scale(m.per_layer, S)
    diag.verdict = f"{m.precision} gradients underflow at S={S:g}: {len(f.damaged)} layer(s) lose gradient"
    if best is not None and best != S:
        who = sorted(k for k, v in m.chosen.items() if v == best)
        lost = max(d.lost_frac for d in m.per_layer if d.scale == best)
        by = f"chosen by {', '.join(who)}" if who else f"2x below the overflow bound {f.safe:.4g}"
        diag.evidence.append(f"at S={best:.4g} ({by}) the worst layer loses {pct(lost)}")
        diag.fix = (f"the scale {best:.4g}: strategy={who[0]}, or bf16" if who else
                    f"a scale near {best:.4g} (strategy=underflow_target or amax_history, which place S "
                    "from the gradient's range), or bf16")
    else:
        diag.fix = (f"raise the scale toward the safe {f.safe:.4g} (strategy=underflow_target or max_ema), "
                    "or train in bf16")


def _block_clipping(f: Facts, diag: Diagnosis) -> None:
    worst = f.clipping[0]
    diag.first_module, diag.tensor, diag.value = worst.layer, f"{worst.layer} {worst.role}", worst.clip_error_share
    for c in f.clipping[:3]:
        diag.evidence.append(f"{c.layer} {c.role}: {pct(c.clip_error_share)} of {c.blocks} blocks saturate their max "
                             f"element to the format max ({pct(c.clipped_share)} saturate at all) under "
                             f"{recipe_label(c.recipe)}")
    diag.verdict = (f"{recipe_label(worst.recipe).split(' (')[0]} clips {pct(worst.clip_error_share)} of "
                    f"{worst.role} blocks in {worst.layer}")
    diag.fix = scale_fix(worst)


def _healthy(f: Facts, diag: Diagnosis) -> None:
    diag.verdict = f"no overflow, no underflow damage above {pct(f.underflow_threshold)} at S={f.m.scale:g}"
    diag.fix = "nothing to fix for this step"


DECISIONS: tuple[Decision, ...] = (
    Decision("nan_in_data_or_loss", lambda f: bool(f.m.bad_inputs) or not f.m.fp32_finite, _nan_in_data_or_loss,
             "a floating tensor of the batch (or a parameter: an earlier step\n"
             "already wrote NaN into the weights) holds NaN/Inf, or the fp32 forward itself is non-finite\n"
             "(the loss, not the format, is broken);"),
    Decision("grads_not_cleared", _accumulated, _grads_not_cleared,
             "the parameters held gradients before the step whose norm is at least\n"
             "``2x`` this step's fp32 gradient norm (accumulated over steps: ``zero_grad`` missing), or\n"
             "non-finite ones (an earlier overflow left in ``.grad``: every later step overflows too);"),
    Decision("lr_spike", lambda f: f.overflow and f.spike is not None, _lr_spike_found,
             "the step overflows (forward or backward) and the last learning rate of\n"
             "``lr_history`` (at least three rates) is at least ``2x`` the largest of the earlier ones (a\n"
             "jump); or the overflow is scale-independent (forward, or backward at ``S = 1`` too) and the\n"
             "last rate is the window's peak and at least ``2x`` its smallest (a loss spike at the peak of\n"
             "a short warmup to a high learning rate; the scaler's own probing during a warmup is not one);"),
    Decision("forward_overflow", lambda f: not f.m.fwd_finite, _forward_overflow,
             "the mixed forward is non-finite while the fp32 forward is finite\n"
             "(no loss scale can help: the scale acts on the backward only);"),
    Decision("gradient_overflow", lambda f: not f.m.grads_finite and not f.m.at_one_finite, _gradient_overflow,
             "the backward overflows at ``S`` *and* at ``S = 1``: genuine\n"
             "gradient overflow, independent of the scale;"),
    Decision("scale_overflow", lambda f: not f.m.grads_finite, _scale_overflow,
             "the backward overflows at ``S`` only: the scaler's normal probing, it\n"
             "backs off (benign unless it repeats at every scale);"),
    Decision("underflow", lambda f: bool(f.damaged), _underflow,
             "some layer loses at least ``underflow_threshold`` (1%) of its nonzero\n"
             "gradient entries, or its cosine to fp32 is below 0.99;"),
    Decision("block_clipping", lambda f: bool(f.clipping), _block_clipping,
             "a block-scaled run (``blocks``): some Linear's operand in some role has at\n"
             "least ``block_clip_threshold`` (10%) of its blocks' max elements changed by saturation (MX\n"
             "FLOOR scale rounding: arXiv 2506.08027, ROCm/aiter PR 3212);"),
    Decision("healthy", lambda f: True, _healthy, "none of the above."),
)
"""The decision list, in order: the first decision that holds names the cause (one per cause of
:data:`strategies.doctor.verdict.CAUSES`)."""


def decision_list() -> str:
    """:data:`DECISIONS` as a numbered list (reStructuredText and Markdown alike), each entry's
    continuation lines indented under its first."""
    return "\n".join(f"{i}. ``{d.cause}`` — " + d.doc.replace("\n", "\n" + " " * (len(str(i)) + 2))
                     for i, d in enumerate(DECISIONS, 1))


def decide(m: Measured, model: torch.nn.Module, params: list[torch.nn.Parameter],
           lr_history: Sequence[float] | None, underflow_threshold: float,
           block_clip_threshold: float = BLOCK_CLIP_THRESHOLD) -> Diagnosis:
    """The cause of the first decision of :data:`DECISIONS` that holds for the measured step ``m``."""
    S = m.scale
    facts = Facts(m, model, params, lr_history, underflow_threshold,
                  spike=_lr_spike(lr_history, not m.fwd_finite or (not m.grads_finite and not m.at_one_finite)),
                  safe=safe_scale(m.fmax, m.ref_rec, m.ref),
                  damaged=[d for d in m.per_layer
                           if d.scale == S and (d.lost_frac >= underflow_threshold or d.cosine < 0.99)],
                  clipping=sorted((c for c in m.block_clips if c.clip_error_share >= block_clip_threshold),
                                  key=lambda c: -c.clip_error_share))
    decision = next(d for d in DECISIONS if d.holds(facts))
    diag = Diagnosis(cause=decision.cause, verdict="", fix="", precision=m.precision, scale=S, per_layer=m.per_layer,
                     strategy_scales=m.chosen, not_compared=m.skipped, passes=m.passes)
    decision.explain(facts, diag)
    return diag
