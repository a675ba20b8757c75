"""The early warning's detector (``strategies.watch.detector``): its six features over an expanding
window, re-stated here in plain Python from the module docstring, the score as the logistic of them,
and the alarm at the first step the score reaches the threshold."""

from __future__ import annotations

import math
from statistics import median

from strategies.watch.detector import CAP, FEATURES, Detector, Observation

W = 8
FP16_MAX = 65504.0


def obs(n: int, onset: int) -> list[Observation]:
    """A run whose first step is skipped (a new scale calibrating), whose forward abs-max grows by half
    a step from ``onset - 8`` until it overflows, and whose gradients double and steps are all skipped
    from ``onset`` on; the scale halves at each skip; the loss grows by 10% a step from there."""
    out, scale, loss, amax, act = [], 1024.0, 2.0, 1.0, 3000.0
    for step in range(1, n + 1):
        bad = step >= onset
        if bad:
            amax, loss = amax * 2, loss * 1.1
        if step >= onset - 8:
            act = act * 1.5 if act * 1.5 < FP16_MAX else math.inf
        skipped = bad or step == 1
        out.append(Observation(step, scale, skipped, loss, math.nan if skipped and step % 2 else amax, act, FP16_MAX,
                               f"m{step % 3}"))
        if skipped:
            scale /= 2
    return out


def clip(v: float) -> float:
    return CAP if not math.isfinite(v) else max(min(v, CAP), -CAP)


def reference(seq: list[Observation]) -> dict[str, float]:
    """The features at the last step of ``seq`` (windows of up to W steps), from the module docstring."""
    lows: dict[str, list[float]] = {"amax": [], "loss": [], "act": []}
    for t in range(1, len(seq) + 1):
        win = seq[max(0, t - W):t]
        half = win[len(win) // 2:]
        a = [o.grad_absmax for o in half if not o.skipped and math.isfinite(o.grad_absmax)]
        if a:
            lows["amax"].append(median(a))
        lows["loss"].append(sum(o.loss for o in half) / len(half))
        acts = [o.act_absmax for o in half]
        if math.isfinite(median(acts)):
            lows["act"].append(median(acts))
    win = seq[-W:]
    half = win[len(win) // 2:]
    a = [o.grad_absmax for o in half if not o.skipped and math.isfinite(o.grad_absmax)]
    acts = [o.act_absmax for o in half]
    return {"skip_rate": sum(o.skipped for o in win) / W,
            "scale_drop": math.log2(max(o.scale for o in seq) / seq[-1].scale),
            "amax_growth": clip(math.log2(median(a) / min(lows["amax"]))) if a else CAP if 2 * len(half) >= W else 0.0,
            "loss_rise": math.log(lows["loss"][-1] / min(lows["loss"])),
            "act_fill": min(max(acts) / FP16_MAX, 1.0),
            "act_growth": clip(math.log2(median(acts) / min(lows["act"])))}


def test_features_match_their_definition_from_the_first_step() -> None:
    seq = obs(30, onset=20)
    det = Detector(window=W)
    for t, o in enumerate(seq, 1):
        det.update(o)
        want = reference(seq[:t])
        assert det.features.keys() == want.keys() == set(FEATURES)
        for f in FEATURES:
            assert math.isclose(det.features[f], want[f], abs_tol=1e-12), (t, f, det.features[f], want[f])
    first = Detector(window=W)
    first.update(seq[0])  # a new run's first skip: one step of W, no gradient growth read into it
    assert first.features["skip_rate"] == 1 / W and first.features["amax_growth"] == 0.0


def test_no_activations_recorded_reads_as_no_risk() -> None:
    det = Detector(window=W)
    for o in obs(12, onset=20):
        det.update(Observation(o.step, o.scale, o.skipped, o.loss, o.grad_absmax))  # act_absmax NaN: not recorded
    assert det.features["act_fill"] == 0.0 and det.features["act_growth"] == 0.0 and det.act_module is None


def test_the_score_is_the_logistic_of_the_standardised_features_and_the_alarm_its_first_crossing() -> None:
    model = {"features": list(FEATURES), "mean": [0.1, 1.0, 0.0, 0.0, 0.0, 0.0], "scale": [0.2, 2.0, 1.0, 1.0, 1.0, 1.0],
             "coef": [3.0, 0.5, 0.0, 1.0, 0.0, 0.0], "intercept": -4.0, "threshold": 0.7}
    det = Detector(model, window=W)
    seq = obs(30, onset=20)
    scores = det.run(seq)
    fresh = Detector(model, window=W)
    for o, s in zip(seq, scores):
        fresh.update(o)
        z = -4.0 + sum(c * (fresh.features[f] - m) / sd for f, m, sd, c in
                       zip(FEATURES, model["mean"], model["scale"], model["coef"]))
        assert math.isclose(s, 1 / (1 + math.exp(-z)), rel_tol=1e-12)
    first = next(o.step for o, s in zip(seq, scores) if s >= 0.7)
    assert det.alarm_step == first and first >= 20  # the clean prefix (its first skip included) never alarms
    assert det.reason().startswith("overflows: ") and f"of the last {W} steps" in det.reason()  # skip_rate leads


def test_the_forward_headroom_alarms_before_any_skip_and_names_its_module() -> None:
    model = {"features": ["act_fill"], "mean": [0.0], "scale": [1.0], "coef": [10.0], "intercept": -6.0, "threshold": 0.5}
    seq = obs(30, onset=20)
    det = Detector(model, window=W)
    det.run(seq)
    want = next(o for o in seq if o.act_absmax / FP16_MAX >= 0.6)  # 10 * fill - 6 >= 0
    assert det.alarm_step == want.step < 20
    det = Detector(model, window=W)
    det.run(seq[:want.step])
    assert det.reason() == (f"forward activations at {100 * want.act_absmax / FP16_MAX:.0f}% of the format's max "
                            f"({math.log2(FP16_MAX / want.act_absmax):.2f} binades of headroom) in {want.act_module}")


def test_a_model_of_fewer_features_reads_only_those() -> None:
    old = {"features": ["skip_rate", "scale_drop", "amax_growth", "loss_rise"], "mean": [0.0] * 4, "scale": [1.0] * 4,
           "coef": [1.0, 1.0, 1.0, 1.0], "intercept": 0.0, "threshold": 0.9}
    det = Detector(old, window=W)
    det.run(obs(10, onset=20))
    assert set(det.contributions()) == set(old["features"])
