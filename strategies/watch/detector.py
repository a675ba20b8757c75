"""The early warning: a run heading for its scale floor, divergence or a stall, flagged from the
telemetry a loop already has — the scale, the skipped steps, the loss, the gradient abs-max — and
the forward activation abs-max (the trace's ``act_absmax``: ``strategies/tracing/activations.py``).

Each step gives an :class:`Observation`; :class:`Detector` keeps a window of the last (up to)
:data:`WINDOW` of them — an expanding window from the first step, so that a run failing in its first
steps has features too — and computes six features (``docs/early-warning.md`` explains them and
shows their effect); "the window's second half" is its last ``ceil(n / 2)`` steps:

* ``skip_rate`` — skipped steps in the window / :data:`WINDOW` (steps before the first count as
  clean, so that one early skip reads as one in a full window, not as 100%);
* ``scale_drop`` — ``log2(peak scale so far / scale now)``: how many halvings below its peak the
  scale has fallen (a scale heading for its floor);
* ``amax_growth`` — ``log2(median gradient abs-max of the window's second half / lowest such median
  so far)``: gradients growing back from their low (attention logits, an FFN output, a rising
  learning rate); a second half of skipped steps only: :data:`CAP` once it holds ``WINDOW / 2``
  steps (before that, 0: a new run's first skips calibrate its scale);
* ``loss_rise`` — ``ln(mean loss of the window's second half / lowest such mean so far)``
  (non-finite: :data:`CAP`): the loss climbing from its best;
* ``act_fill`` — ``max forward activation abs-max of the window's second half / the forward format's
  max`` in [0, 1] (0: not recorded): how much of the fp16 range the forward uses,
  ``2^-headroom`` with ``headroom = log2(65504 / amax)`` — the precursor of a forward overflow,
  which the gradients cannot show (a forward overflow's loss is non-finite before any scaling);
* ``act_growth`` — ``log2(median activation abs-max of the window's second half / lowest such
  median so far)`` (0: not recorded): the forward's abs-max climbing toward the format's max.

The score is a logistic regression of the standardised features, ``sigmoid(b + sum_i w_i (f_i -
mu_i) / sd_i)``, with the coefficients :data:`strategies.watch.fitted.MODEL` fitted by
``make warning-eval`` on held-in seeds; an alarm is a score at or above its ``threshold`` (chosen
there for <= 5% false alarms on healthy training runs). A model names its features (``"features"``):
one fitted on fewer reads only those. The reason given is the feature that pushed the score most.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any, Iterable

from strategies.watch.fitted import MODEL

__all__ = ["CAP", "FEATURES", "WINDOW", "Detector", "Observation", "observations", "reason_words"]

FEATURES = ("skip_rate", "scale_drop", "amax_growth", "loss_rise", "act_fill", "act_growth")
WINDOW = 16
CAP = 20.0
"""The value a feature takes when its ratio is not finite (a NaN loss, an all-skipped window)."""


@dataclass(frozen=True)
class Observation:
    """One step as the detector sees it (``grad_absmax`` NaN on a skipped step; ``act_absmax`` the
    forward activation abs-max against the format's ``act_max``, NaN when not recorded, and the
    module holding it)."""

    step: int
    scale: float
    skipped: bool
    loss: float
    grad_absmax: float
    act_absmax: float = math.nan
    act_max: float = math.nan
    act_module: str | None = None


def observations(trace: Any) -> list[Observation]:
    """The observations of a :class:`strategies.tracing.Trace` (loss-side scale)."""
    return [Observation(s, row[-1], bool(f), l, a, act, trace.act_max, trace.act_name(j)) for j, (s, row, f, l, a, act) in
            enumerate(zip(trace.steps, trace.scale, trace.found_inf, trace.loss, trace.grad_absmax, trace.act_absmax))]


def _log_ratio(a: float, b: float, log=math.log2) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
        return CAP
    return max(min(log(a / b), CAP), -CAP)


class Detector:
    """Online early warning over :class:`Observation` s (module docstring).

    Args:
        model: ``{"mean", "scale", "coef", "intercept", "threshold"}`` (default: the fitted one).
        window: steps per window.
    """

    def __init__(self, model: dict[str, Any] | None = None, window: int = WINDOW) -> None:
        self.model = dict(MODEL if model is None else model)
        self.window = window
        self._obs: deque[Observation] = deque(maxlen=window)
        self._peak_scale = 0.0
        self._low_amax = math.inf
        self._low_loss = math.inf
        self._low_act = math.inf
        self.act_module: str | None = None
        self.features: dict[str, float] = {}
        self.score = 0.0
        self.alarm_step: int | None = None

    @property
    def threshold(self) -> float:
        return float(self.model["threshold"])

    def _features(self) -> dict[str, float]:
        obs = list(self._obs)
        half = obs[len(obs) // 2:]
        amax = [o.grad_absmax for o in half if not o.skipped and math.isfinite(o.grad_absmax)]
        loss = [o.loss for o in half]
        med = median(amax) if amax else math.nan
        mean_loss = sum(loss) / len(loss) if all(math.isfinite(x) for x in loss) else math.nan
        if math.isfinite(med) and med > 0:
            self._low_amax = min(self._low_amax, med)
        if math.isfinite(mean_loss) and mean_loss > 0:
            self._low_loss = min(self._low_loss, mean_loss)
        return {
            "skip_rate": sum(o.skipped for o in obs) / self.window,
            "scale_drop": max(_log_ratio(self._peak_scale, obs[-1].scale), 0.0),
            "amax_growth": _log_ratio(med, self._low_amax) if amax else CAP if 2 * len(half) >= self.window else 0.0,
            "loss_rise": _log_ratio(mean_loss, self._low_loss, math.log),
            **self._act_features(half),
        }

    def _act_features(self, half: list[Observation]) -> dict[str, float]:
        """``act_fill`` and ``act_growth`` (module docstring): 0 where no activation was recorded."""
        seen = [o for o in half if not math.isnan(o.act_absmax) and math.isfinite(o.act_max)]
        if not seen:
            self.act_module = None
            return {"act_fill": 0.0, "act_growth": 0.0}
        top = max(seen, key=lambda o: o.act_absmax)
        self.act_module = top.act_module
        med = median(o.act_absmax for o in seen)
        if math.isfinite(med) and med > 0:
            self._low_act = min(self._low_act, med)
        growth = _log_ratio(med, self._low_act) if math.isfinite(self._low_act) else 0.0
        return {"act_fill": min(top.act_absmax / top.act_max, 1.0), "act_growth": growth}

    def contributions(self) -> dict[str, float]:
        """Each feature's term ``w_i (f_i - mu_i) / sd_i`` in the score's logit."""
        m = self.model
        return {f: m["coef"][i] * (self.features[f] - m["mean"][i]) / m["scale"][i]
                for i, f in enumerate(m.get("features", FEATURES))}

    def update(self, obs: Observation) -> float:
        """Feed one step; return the score (from the first step: an expanding window). Sets
        :attr:`alarm_step` at the first step whose score reaches the threshold."""
        self._obs.append(obs)
        if math.isfinite(obs.scale):
            self._peak_scale = max(self._peak_scale, obs.scale)
        self.features = self._features()
        z = self.model["intercept"] + sum(self.contributions().values())
        self.score = 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))
        if self.alarm_step is None and self.score >= self.threshold:
            self.alarm_step = obs.step
        return self.score

    def run(self, obs: Iterable[Observation]) -> list[float]:
        """Scores of a whole sequence (fresh state per call is the caller's: use a new Detector)."""
        return [self.update(o) for o in obs]

    def reason(self) -> str:
        """The warning in words, led by the feature that pushed the score most."""
        return reason_words(self.features, self.contributions() if self.features else {}, self.window, self.act_module)


def reason_words(features: dict[str, float], contributions: dict[str, float], window: int = WINDOW,
                 act_module: str | None = None) -> str:
    """E.g. ``"scale heading for its floor (6 halvings below its peak)"``, ``"forward activations at
    88% of the format's max (0.18 binades of headroom) in blocks.0.fc_out"``."""
    if not features:
        return "no warning yet"
    fill = features.get("act_fill", 0.0)
    headroom = -math.log2(fill) if fill > 0 else math.inf
    words = {
        "act_fill": f"forward activations at {100 * fill:.0f}% of the format's max ({headroom:.2f} binades of "
                    f"headroom){f' in {act_module}' if act_module else ''}",
        "act_growth": f"forward activations growing ({2 ** min(features.get('act_growth', 0.0), 30):.3g}x their low)"
                      f"{f' in {act_module}' if act_module else ''}",
        "scale_drop": f"scale heading for its floor ({features['scale_drop']:.0f} halvings below its peak)",
        "skip_rate": f"overflows: {100 * features['skip_rate']:.0f}% of the last {window} steps skipped",
        "amax_growth": f"gradients growing ({2 ** min(features['amax_growth'], 30):.3g}x their low)",
        "loss_rise": f"loss rising ({math.exp(min(features['loss_rise'], 30)):.3g}x its best)",
    }
    ranked = sorted(contributions, key=contributions.get, reverse=True)
    return "; ".join(words[f] for f in ranked[:2] if contributions[f] > 0) or words[ranked[0]]
