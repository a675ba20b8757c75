"""`amax_history` against a re-statement of TransformerEngine's delayed-scaling update.

TransformerEngine ``transformer_engine/common/recipe/delayed_scaling.cu``
``amax_and_scale_update_impl::kernel`` (one scale): the step's amax is written to
``history[0]``; the kernel takes amax = max of the history (``"max"``) or ``history[0]``
(``"most_recent"``), rolls the history (``new[i] = history[i + 1]``, ``new[L - 1] = history[0]``,
``new[0] = 0``) and sets ``scale = (fp8_max * 2^-margin) / amax`` in float32 when amax is finite
and > 0, else keeps the scale. The loss-scale rule adds (issue 11 item 4) that a non-finite step
backs S off, and (issue 20) that it is recorded too, as TE records every step's amax: its amax
is unknown, so the history gets its lower bound format_max / S (some scaled gradient passed
format_max). Random abs-max and overflow sequences go through real scale/unscale_/step/update
calls; the scale after every update must equal the re-statement's.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import strategies
from tests.helpers import forbid_host_sync


class DelayedScaling:
    """TE's amax-and-scale update for one scale, float32 as in the kernel."""

    def __init__(self, scale: float, history_len: int, algo: str, fp8_max: float, margin: float, backoff: float):
        self.scale = np.float32(scale)
        self.amax_history = [np.float32(0.0)] * history_len
        self.algo, self.backoff, self.format_max = algo, backoff, np.float32(fp8_max)
        self.scaled_max = np.float32(fp8_max) * np.float32(2.0 ** -margin)  # fp8_dtype_max * pow(2, -margin)

    def kernel(self, found_inf: bool) -> None:
        h = self.amax_history
        last_amax = h[0]
        rolled = [h[i + 1] if i < len(h) - 1 else last_amax for i in range(len(h))]
        amax = max(rolled) if self.algo == "max" else last_amax
        self.amax_history = [np.float32(0.0)] + rolled[1:]
        if found_inf:  # the loss-scale rule: S * backoff_factor
            self.scale = np.float32(self.scale * self.backoff)
        elif math.isfinite(amax) and amax > 0:
            self.scale = np.float32(self.scaled_max / np.float32(amax))

    def step(self, found_inf: bool, amax: float) -> float:
        # the step's amax, written during the step; an overflow's lower bound format_max / S
        self.amax_history[0] = np.float32(self.format_max / self.scale) if found_inf else np.float32(amax)
        self.kernel(found_inf)
        return float(self.scale)


def run(s, steps: list[tuple[bool, float]]) -> list[tuple[float, float]]:
    """A real loop on a 3-vector parameter whose unscaled gradient has abs-max ``magnitude``
    (or is poisoned with Inf); (grad_absmax, scale) after each update."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt, out = torch.optim.SGD([p], lr=0.0), []
    for bad, magnitude in steps:
        p.grad = None
        s.scale((p * torch.tensor([magnitude, magnitude / 3, 0.0])).sum()).backward()
        p.grad[2] = math.inf if bad else 0.0
        with forbid_host_sync():
            s.unscale_(opt)
        s.step(opt)  # the one allowed host read
        with forbid_host_sync():
            s.update()
        absmax, scale = s.telemetry()["grad_absmax"].item(), s.get_scale()
        assert bad or absmax == pytest.approx(magnitude, rel=1e-6)
        out.append((absmax, scale))
    return out


def random_case(seed: int):
    rng = random.Random(2000 + seed)
    p_bad = rng.choice([0.0, 0.1, 0.3])
    steps = [(rng.random() < p_bad, rng.choice([0.0, 10.0 ** rng.uniform(-5, 3)]) if rng.random() < 0.1
              else 10.0 ** rng.uniform(-5, 3)) for _ in range(rng.randint(10, 40))]
    knobs = dict(history_len=rng.choice([1, 2, 3, 5, 16]), algo=rng.choice(["max", "most_recent"]),
                 margin=rng.choice([0.0, 1.0, 3.0]), format_max=rng.choice([65504.0, 448.0, 57344.0]),
                 init_scale=2.0 ** rng.randint(0, 16))
    return steps, knobs


SEEDS = range(20)


@pytest.mark.parametrize("track_stats", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_equals_transformer_engine(seed: int, track_stats: bool) -> None:
    steps, k = random_case(seed)
    s = strategies.create("amax_history", track_stats=track_stats, **k)
    ref = DelayedScaling(k["init_scale"], k["history_len"], k["algo"], k["format_max"], k["margin"], 0.5)
    observed = run(s, steps)
    expected = [ref.step(bad, absmax) for (bad, _), (absmax, _) in zip(steps, observed)]
    assert [scale for _, scale in observed] == expected


def test_the_random_cases_reach_every_branch() -> None:
    cases = [random_case(seed) for seed in SEEDS]
    all_steps = [st for steps, _ in cases for st in steps]
    assert any(bad for bad, _ in all_steps) and any(m == 0.0 and not bad for bad, m in all_steps)
    assert {k["algo"] for _, k in cases} == {"max", "most_recent"}


def test_hand_computed() -> None:
    """history 2, format_max 64, margin 1 (scaled max 32): an overflow at S backs off to S*0.5 and
    records format_max / S (step 1: 1/16, so step 2's all-zero gradients keep 32 / (1/16) = 512;
    step 6: 1, kept in the window by step 7); amax 0 (all-zero gradients, most_recent) keeps S."""
    s = strategies.create("amax_history", init_scale=1024.0, history_len=2, format_max=64.0, margin=1.0)
    steps = [(True, 1.0), (False, 0.0), (False, 2.0), (False, 0.5), (False, 0.25), (True, 8.0), (False, 1.0)]
    assert [sc for _, sc in run(s, steps)] == [512.0, 512.0, 16.0, 16.0, 64.0, 32.0, 32.0]
    assert s.telemetry()["amax_history"].tolist() == [1.0, 1.0]
    m = strategies.create("amax_history", init_scale=1024.0, history_len=2, format_max=64.0, margin=1.0,
                          algo="most_recent")
    assert [sc for _, sc in run(m, steps)] == [512.0, 512.0, 16.0, 64.0, 128.0, 64.0, 32.0]


def test_a_quotient_that_overflows_float32_keeps_the_scale() -> None:
    s = strategies.create("amax_history", init_scale=8.0, history_len=1)
    assert [sc for _, sc in run(s, [(False, 1e-39)])] == [8.0]


def test_an_overflow_at_a_tiny_scale_records_a_finite_bound_and_saves() -> None:
    """format_max / S overflows float32 below S = 65504 / FLT_MAX: the bound is FLT_MAX, and the
    state still saves and loads (a state holds finite numbers)."""
    s = strategies.create("amax_history", init_scale=2.0**-120, history_len=2)
    run(s, [(True, 1.0)])
    assert s.telemetry()["amax_history"].tolist() == [0.0, torch.finfo(torch.float32).max]
    strategies.create("amax_history", history_len=2).load_state_dict(s.state_dict())


def test_defaults_are_te_delayed_scaling_with_margin_one() -> None:
    p = strategies.create("amax_history").params
    assert (p.history_len, p.algo, p.margin) == (1024, "max", 1.0)


def overflows_while_growing(margin: float, growth: float, steps: int = 60) -> int:
    """Steps that overflow in a loop whose gradient abs-max grows by `growth` per step (a step
    overflows when abs-max * S passes format_max, as its fp16 gradient would)."""
    s = strategies.create("amax_history", init_scale=1.0, margin=margin)
    magnitude, overflows = 1e-3, 0
    for _ in range(steps):
        bad = magnitude * s.get_scale() > 65504.0
        overflows += bad
        run(s, [(bad, magnitude)])
        magnitude *= growth
    return overflows


def test_growing_gradients_skip_nothing_with_the_default_margin() -> None:
    """Issue 20: with margin 0 every step whose gradient exceeds the history's max overflows (S
    sits exactly at format_max / A); margin 1 absorbs growth below 2x per step."""
    assert overflows_while_growing(1.0, 1.9) == 0
    assert overflows_while_growing(0.0, 1.05) >= 25  # every other step
    assert overflows_while_growing(1.0, 2.5) > 0  # growth beyond the margin still overflows


def test_history_is_saved_and_validated() -> None:
    s = strategies.create("amax_history", history_len=4, format_max=64.0)
    run(s, [(False, 2.0), (False, 1.0)])
    sd = s.state_dict()
    assert sd["extra"]["amax_history"] == [0.0, 0.0, 2.0, 1.0]
    t = strategies.create("amax_history", history_len=4, format_max=64.0)
    t.load_state_dict(sd)
    assert run(t, [(False, 0.5)])[0][1] == run(s, [(False, 0.5)])[0][1] == 16.0
    with pytest.raises(ValueError, match=r"^state_dict entry 'amax_history' must be a list of 3 numbers"):
        strategies.create("amax_history", history_len=3).load_state_dict(sd)
    bad = dict(sd, extra=dict(sd["extra"], amax_history=[0.0, -1.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match=r"'amax_history\[1\]' must be >= 0"):
        strategies.create("amax_history", history_len=4).load_state_dict(bad)


@pytest.mark.parametrize("field,value,message", [
    ("history_len", 0, "history_len must be an integer >= 1, got 0"),
    ("algo", "mean", "algo must be one of 'max', 'most_recent', got 'mean'"),
    ("margin", -1.0, "margin must be in [0, 64), got -1.0"),
    ("format_max", 0.0, "format_max must be finite and > 0, got 0.0"),
])
def test_new_fields_validated(field: str, value, message: str) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("amax_history", **{field: value})
    assert str(e.value) == message
