"""The early warning's detector (``strategies.watch.detector``): its four features over a window,
re-stated here in plain Python from the module docstring, the score as the logistic of them, and the
alarm at the first step the score reaches the threshold."""

from __future__ import annotations

import math
from statistics import median

from strategies.watch.detector import CAP, FEATURES, Detector, Observation

W = 8


def obs(n: int, onset: int) -> list[Observation]:
    """A run whose gradients double and whose steps are all skipped from ``onset`` on; the scale
    halves at each skip; the loss grows by 10% a step from there."""
    out, scale, loss, amax = [], 1024.0, 2.0, 1.0
    for step in range(1, n + 1):
        bad = step >= onset
        if bad:
            amax, loss = amax * 2, loss * 1.1
        out.append(Observation(step, scale, bad, loss, math.nan if bad and step % 2 else amax))
        if bad:
            scale /= 2
    return out


def reference(seq: list[Observation]) -> dict[str, float]:
    """The features at the last step of ``seq`` (windows of W), from the module docstring."""
    lows_amax, lows_loss = [], []
    for t in range(W, len(seq) + 1):
        half = seq[t - W:t][W // 2:]
        a = [o.grad_absmax for o in half if not o.skipped and math.isfinite(o.grad_absmax)]
        if a:
            lows_amax.append(median(a))
        lows_loss.append(sum(o.loss for o in half) / len(half))
    win = seq[-W:]
    a = [o.grad_absmax for o in win[W // 2:] if not o.skipped and math.isfinite(o.grad_absmax)]
    return {"skip_rate": sum(o.skipped for o in win) / W,
            "scale_drop": math.log2(max(o.scale for o in seq) / seq[-1].scale),
            "amax_growth": math.log2(median(a) / min(lows_amax)) if a else CAP,
            "loss_rise": math.log(lows_loss[-1] / min(lows_loss))}


def test_features_match_their_definition() -> None:
    seq = obs(30, onset=20)
    det = Detector(window=W)
    for t, o in enumerate(seq, 1):
        det.update(o)
        if t >= W:
            want = reference(seq[:t])
            assert det.features.keys() == want.keys()
            for f in FEATURES:
                assert math.isclose(det.features[f], want[f], abs_tol=1e-12), (t, f, det.features[f], want[f])


def test_the_score_is_the_logistic_of_the_standardised_features_and_the_alarm_its_first_crossing() -> None:
    model = {"features": list(FEATURES), "mean": [0.1, 1.0, 0.0, 0.0], "scale": [0.2, 2.0, 1.0, 1.0],
             "coef": [3.0, 0.5, 0.0, 1.0], "intercept": -4.0, "threshold": 0.7}
    det = Detector(model, window=W)
    seq = obs(30, onset=20)
    scores = det.run(seq)
    assert scores[:W - 1] == [0.0] * (W - 1)  # nothing before the window is full
    fresh = Detector(model, window=W)
    for o, s in zip(seq, scores):
        fresh.update(o)
        if fresh.features:
            z = -4.0 + sum(c * (fresh.features[f] - m) / sd for f, m, sd, c in
                           zip(FEATURES, model["mean"], model["scale"], model["coef"]))
            assert math.isclose(s, 1 / (1 + math.exp(-z)), rel_tol=1e-12)
    first = next(o.step for o, s in zip(seq, scores) if s >= 0.7)
    assert det.alarm_step == first and first >= 20  # the clean prefix never alarms
    assert det.reason().startswith("overflows: ") and f"of the last {W} steps" in det.reason()  # skip_rate leads
