"""The early warning: a run heading for its scale floor, divergence or a stall, flagged from the
telemetry a loop already has — the scale, the skipped steps, the loss and the gradient abs-max.

Each step gives an :class:`Observation`; :class:`Detector` keeps a window of the last
:data:`WINDOW` of them and computes four features (``docs/early-warning.md`` explains them and
shows their effect):

* ``skip_rate`` — the fraction of the window's steps that were skipped (overflows);
* ``scale_drop`` — ``log2(peak scale so far / scale now)``: how many halvings below its peak the
  scale has fallen (a scale heading for its floor);
* ``amax_growth`` — ``log2(median abs-max of the window's second half / lowest such median so
  far)``: gradients growing back from their low (attention logits, an FFN output, a rising
  learning rate);
* ``loss_rise`` — ``ln(mean loss of the window's second half / lowest such mean so far)``
  (non-finite: :data:`CAP`): the loss climbing from its best.

The score is a logistic regression of the standardised features, ``sigmoid(b + sum_i w_i (f_i -
mu_i) / sd_i)``, with the coefficients :data:`strategies.watch.fitted.MODEL` fitted by
``make warning-eval`` on held-in workloads and seeds; an alarm is a score at or above its
``threshold`` (chosen there for <= 5% false alarms on healthy training runs), never before the
window is full. The reason given is the feature that pushed the score most.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any, Iterable

from strategies.watch.fitted import MODEL

__all__ = ["CAP", "FEATURES", "WINDOW", "Detector", "Observation", "observations", "reason_words"]

FEATURES = ("skip_rate", "scale_drop", "amax_growth", "loss_rise")
WINDOW = 16
CAP = 20.0
"""The value a feature takes when its ratio is not finite (a NaN loss, an all-skipped window)."""


@dataclass(frozen=True)
class Observation:
    """One step as the detector sees it (``grad_absmax`` NaN on a skipped step)."""

    step: int
    scale: float
    skipped: bool
    loss: float
    grad_absmax: float


def observations(trace: Any) -> list[Observation]:
    """The observations of a :class:`strategies.tracing.Trace` (loss-side scale)."""
    return [Observation(s, row[-1], bool(f), l, a) for s, row, f, l, a in
            zip(trace.steps, trace.scale, trace.found_inf, trace.loss, trace.grad_absmax)]


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
            "skip_rate": sum(o.skipped for o in obs) / len(obs),
            "scale_drop": max(_log_ratio(self._peak_scale, obs[-1].scale), 0.0),
            "amax_growth": _log_ratio(med, self._low_amax) if amax else CAP,
            "loss_rise": _log_ratio(mean_loss, self._low_loss, math.log),
        }

    def contributions(self) -> dict[str, float]:
        """Each feature's term ``w_i (f_i - mu_i) / sd_i`` in the score's logit."""
        m = self.model
        return {f: m["coef"][i] * (self.features[f] - m["mean"][i]) / m["scale"][i] for i, f in enumerate(FEATURES)}

    def update(self, obs: Observation) -> float:
        """Feed one step; return the score (0 until the window is full). Sets :attr:`alarm_step`
        at the first step whose score reaches the threshold."""
        self._obs.append(obs)
        if math.isfinite(obs.scale):
            self._peak_scale = max(self._peak_scale, obs.scale)
        if len(self._obs) < self.window:
            return 0.0
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
        return reason_words(self.features, self.contributions() if self.features else {}, self.window)


def reason_words(features: dict[str, float], contributions: dict[str, float], window: int = WINDOW) -> str:
    """E.g. ``"scale heading for its floor (6 halvings below its peak)"``."""
    if not features:
        return "no warning yet"
    words = {
        "scale_drop": f"scale heading for its floor ({features['scale_drop']:.0f} halvings below its peak)",
        "skip_rate": f"overflows: {100 * features['skip_rate']:.0f}% of the last {window} steps skipped",
        "amax_growth": f"gradients growing ({2 ** min(features['amax_growth'], 30):.3g}x their low)",
        "loss_rise": f"loss rising ({math.exp(min(features['loss_rise'], 30)):.3g}x its best)",
    }
    ranked = sorted(contributions, key=contributions.get, reverse=True)
    return "; ".join(words[f] for f in ranked[:2] if contributions[f] > 0) or words[ranked[0]]
