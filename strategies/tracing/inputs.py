"""What a replayed rule is fed at each recorded step: the overflow model, its ``GradStats`` rebuilt
from the trace, the inputs its hooks would have observed, and the rules whose input no trace holds.

**Overflow under another scale** (the trace recorded the *unscaled* gradients; a scale ``S'``
multiplies them back). For step ``i`` and layer group ``l`` with recorded abs-max ``a_il``, recorded
scale ``S_il`` and the format's largest value ``M`` (``trace.format.max``):

* the loss itself is not finite → the step overflows at every scale: the forward overflowed or
  the data held a NaN, which no scale fixes;
* ``a_il`` finite (no overflow at ``S_il``) → group ``l`` overflows iff ``S'_l > S_il`` and
  ``a_il * S'_l >= M`` (never for a saturating format, fp8 e4m3, whose casts clip instead). A
  scale at or below the recorded one cannot overflow (a recorded run replays as itself), and
  above it the parameter gradients' abs-max stands for the gradients inside backward;
* ``a_il`` not finite (the recorded step overflowed there): the true abs-max is unknown, only that
  it is at least ``M / S_il``. Three models (``overflow=``):

  - ``persist``: it overflows at every scale (a spike, a NaN, an overflowing activation);
  - ``bound``: it overflows iff ``S'_l >= S_il``; below, the lower bound ``M / S_il`` is its abs-max;
  - ``auto`` (the default, chosen by the measurements of ``docs/replay.md``): ``bound`` when the
    group's gradients of the :data:`RECENT` clean steps before were already within a factor
    :data:`NEAR` of overflowing at ``S_il`` (``max a * S_il >= NEAR * M``: the *scale* overflowed,
    as a rule that rides the edge does), else ``persist`` (a jump no scale near the recorded one
    survives). A step with no clean step before it (a run that opens with a string
    of overflows from a 2^32 initial scale, as Megatron's and AReaL's presets do) is judged by the
    first :data:`RECENT` clean steps after it: in ``make replay-check``'s court traces, judging
    those as jumps made every other preset skip them all. Only clean steps are evidence: an
    overflow step's finite groups are the ones that did not overflow, and once the trace recorded
    an overflowing group as ``inf`` (not float32's max) such a step's small finite entries made the
    scale's own overflows read as jumps.

A step overflows when any group does. The parameter gradients' abs-max underestimates the
activation gradients inside backward (``strategies/rules/amax_history.py`` measured 61745 < 65504
on a skipped step): this model predicts no overflow there, which ``docs/replay.md`` measures.

Per-layer rules (``layerwise``): the origin of an overflow is the group nearest the loss that
overflows (the gradient flows from group G-1 down); the groups below it are contaminated
(``layerwise``'s own attribution, :func:`strategies.layer_groups.overflow_origin`).
"""

from __future__ import annotations

import math
import torch

from strategies.base import Strategy
from strategies.probe import ReferenceProbe
from strategies.stats import E_BINS, E_LO, GradStats
from strategies.tracing.trace import Histogram, Trace

__all__ = ["MissingInput", "OVERFLOW_MODELS", "check_inputs", "group_overflow", "lost_fractions", "shifted_histogram",
           "step_stats", "unreplayable", "NEAR", "RECENT"]

OVERFLOW_MODELS = ("auto", "persist", "bound")
RECENT = 8
"""Steps before a recorded overflow whose abs-max tells a scale overflow from a jump (``auto``)."""
NEAR = 0.75
"""``auto``: a recorded overflow is the scale's when the recent abs-max times the recorded scale was at
least this fraction of the format's largest value. Between the two cases it must tell apart: a
scale that doubled into an overflow (GradScaler's growth: before it ``a * S`` was in ``[M/2, M)``,
so ``a * S_il`` is in ``[M, 2M)``) and a rule that rides at ``M/2`` by design (``max_ema``'s target
32768 = ``a * S_il`` ~ ``0.5 M``), whose overflow takes a jump of the gradients (``docs/replay.md``:
at 0.5, max_ema's spikes were taken for scale overflows)."""


class MissingInput(ValueError):
    """The strategy reads something the trace does not record (the message says what)."""


def unreplayable(strategy: Any) -> str | None:
    """Why ``strategy`` can be replayed on no trace (its input is never recorded), or None."""
    name = getattr(strategy, "name", type(strategy).__name__)
    if not isinstance(strategy, Strategy):
        return f"{name}: not a scalelab Strategy (its update cannot be fed a trace)"
    if not strategy.is_enabled():
        return f"{name}: disabled (no scaling): nothing to replay"
    if isinstance(strategy, ReferenceProbe):  # norm_ratio, hybrid: the probe's fp32 gradient
        return (f"{name} compares each probe step's gradient with an fp32 reference gradient (its probe); the "
                "trace records none, and replaying it would be a guess")
    if getattr(strategy.params, "rule", None) == "adaloss":
        return f"{name} (rule adaloss) reads each group's activation-gradient statistics and weights; the trace records neither"
    known = strategy.per_group or any(spec.name == "exp_hist" for spec in strategy._specs())
    if type(strategy).attach is not Strategy.attach and not known:
        return f"{name} observes the model through hooks the trace does not record"
    return None


def check_inputs(strategy: Strategy, trace: Trace) -> list[str]:
    """Raise :class:`MissingInput` when ``strategy`` reads what ``trace`` lacks; else return the
    notes on how its inputs are approximated."""
    reason = unreplayable(strategy)
    if reason is not None:
        raise MissingInput(reason)
    name = strategy.name
    notes = []
    if strategy.per_group:
        if not trace.groups or any(math.isnan(a) for row in trace.group_absmax for a in row):
            raise MissingInput(f"{name} reads per-group abs-maxes; this trace has none")
        notes.append(f"{len(trace.groups)} layer groups ({', '.join(trace.groups)}), overflow attributed to the "
                     "group nearest the loss")
    elif any(spec.name == "exp_hist" for spec in strategy._specs()):
        if not trace.histograms:
            raise MissingInput(f"{name} reads the activation-gradient exponent histogram; this trace has none "
                               "(train.hist_every=0)")
        every = _spacing(sorted(trace.histograms))
        notes.append(f"histogram measured at {len(trace.histograms)} steps (every {every}); between them the last "
                     "one of a clean step is held, re-expressed at the replayed scale (the first one before it)")
    if getattr(strategy, "needs_stats", False) and name == "learned":
        notes.append("the underflow fraction it reads is the recorded one (measured at the recorded scale)")
    return notes


def _spacing(steps: list[int]) -> str:
    gaps = sorted({b - a for a, b in zip(steps, steps[1:])})
    return "once" if not gaps else (f"{gaps[0]} steps" if len(gaps) == 1 else f"{gaps[0]}-{gaps[-1]} steps")


def _evidence(trace: Trace, i: int) -> list[list[float]]:
    """The abs-max rows that tell what step ``i``'s overflow was: those of the clean steps (no
    overflow, a finite abs-max) among the :data:`RECENT` steps before it, or, when none is (a run
    that starts by overflowing, e.g. from a 2^32 initial scale), of the first :data:`RECENT` clean
    steps after it."""
    def clean(j: int) -> bool:
        return not trace.found_inf[j] and any(map(math.isfinite, trace.group_absmax[j]))

    before = [trace.group_absmax[j] for j in range(max(0, i - RECENT), i) if clean(j)]
    if before:
        return before
    after = (trace.group_absmax[j] for j in range(i + 1, len(trace.group_absmax)) if clean(j))
    return [row for _, row in zip(range(RECENT), after)]


def _near_overflow(trace: Trace, i: int, rec: list[float]) -> bool:
    """Were the gradients of step ``i``'s evidence (:func:`_evidence`) already within :data:`NEAR` of
    the format's largest value at the recorded scales ``rec`` (in any group)?"""
    peak = max((a * r for row in _evidence(trace, i) for a, r in zip(row, rec) if math.isfinite(a)), default=0.0)
    return peak >= NEAR * trace.format.max


def group_overflow(trace: Trace, i: int, scales: list[float], mode: str) -> tuple[list[bool], list[float]]:
    """Per layer group: does step ``i`` overflow at ``scales`` (one per group, or one for all), and
    the abs-max to feed (``inf`` where it overflows, the lower bound ``M / S`` where a recorded
    overflow is kept below its scale)? The model is the module docstring's."""
    fmt, G = trace.format, len(trace.groups)
    s_new = scales if len(scales) == G else [scales[-1]] * G
    rec = trace.scale[i] if len(trace.scale[i]) == G else [trace.scale[i][-1]] * G
    if not math.isfinite(trace.loss[i]):
        return [True] * G, [math.inf] * G
    amax = list(trace.group_absmax[i])
    if trace.found_inf[i] and all(math.isfinite(a) for a in amax):  # an overflow no group shows
        amax = [math.inf] * G
    jump = mode == "persist" or (mode == "auto" and not all(map(math.isfinite, amax)) and not _near_overflow(trace, i, rec))
    over, feed = [], []
    for a, s, r in zip(amax, s_new, rec):
        if math.isfinite(a):
            o = not fmt.saturates and s > r and a * s >= fmt.max
        elif jump:
            o = True
        else:
            o = s >= r
            a = fmt.max / r
        over.append(o)
        feed.append(math.inf if o else a)
    return over, feed


def step_stats(trace: Trace, i: int, over: list[bool], feed: list[float], per_group: bool,
               device: torch.device) -> tuple[torch.Tensor, GradStats, list[bool]]:
    """``(found_inf, GradStats, contaminated)`` of step ``i`` as the statistics pass would have
    produced them: per layer group for per-layer rules, else one group. Sums and counts are split
    over the groups by their share of the entries (only their totals are recorded)."""
    numel = trace.group_numel if per_group else [trace.numel]
    total = max(sum(numel), 1)
    share = [n / total for n in numel]
    found_any = any(over)
    sumsq = math.inf if found_any else trace.grad_sumsq[i]
    zf, sf = (0.0 if math.isnan(x) else x for x in (trace.zero_frac[i], trace.subnormal_frac[i]))
    if per_group:
        top = max((g for g, o in enumerate(over) if o), default=-1)  # the origin: nearest the loss
        found = [1.0 if (o and g == top) else 0.0 for g, o in enumerate(over)]
        absmax = feed
        contaminated = [g < top for g in range(len(over))]
    else:
        found, absmax, contaminated = [1.0 if found_any else 0.0], [max(feed)], [False]
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    stats = GradStats(
        torch.tensor(found, **f32), torch.tensor(absmax, **f32), torch.tensor([sumsq * s for s in share], **f32),
        torch.tensor([round(zf * n) for n in numel], **i64), torch.tensor([round(sf * n) for n in numel], **i64),
        torch.tensor(numel, **i64))
    return torch.tensor(1.0 if found_any else 0.0, **f32), stats, contaminated


def shifted_histogram(hist: Histogram, ratio: float, trace: Trace, device: torch.device) -> torch.Tensor:
    """``hist`` (measured at the recorded scale) re-expressed at ``ratio`` times that scale, as the
    rule's own observation would count it (``strategies.stats.exponent_histogram``'s bins, float32):
    exponents move by ``round(log2 ratio)``; entries that would flush to zero are dropped (zeros
    are not counted), those past the format's range stay in the top bin (the step overflows)."""
    k = round(math.log2(ratio)) if ratio > 0 and math.isfinite(ratio) else 0
    flush = math.floor(math.log2(trace.format.smallest_subnormal)) - 1
    out = [0.0] * E_BINS
    for j, c in enumerate(hist.counts):
        e = hist.lo + j + k
        if c and e >= flush:
            out[min(max(e - E_LO, 0), E_BINS - 1)] += c
    return torch.tensor(out, dtype=torch.float32, device=device)


def lost_fractions(hist: Histogram, ratio: float, trace: Trace) -> tuple[float, float]:
    """Of the nonzero activation-gradient entries of ``hist``, the fractions that at ``ratio`` times
    the recorded scale fall below half the smallest subnormal (flushed to zero: lost) and below the
    smallest normal (subnormal: precision lost). A bin counts when its upper edge ``2^(e+1)`` does:
    a lower bound for the bin that straddles the threshold."""
    n = sum(hist.counts)
    if n == 0:
        return 0.0, 0.0
    fmt = trace.format
    lost = sub = 0
    for j, c in enumerate(hist.counts):
        top = 2.0 ** (hist.lo + j + 1) * ratio
        if top <= fmt.smallest_subnormal / 2:
            lost += c
        if top <= fmt.smallest_normal:
            sub += c
    return lost / n, sub / n

