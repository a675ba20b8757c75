"""`max_ema` against hand-computed trajectories: the pure rule, then the strategy end to end."""

from __future__ import annotations

import math

import pytest
import torch

import strategies
from strategies.formats import round_down_pow2
from strategies.rules.max_ema import max_ema_update_
from tests.helpers import forbid_host_sync

INF = math.inf


def run_rule(steps, *, S0, decay=0.5, interval=1, round_pow2=False, grow_on_zero=True, cap=False):
    """Feed (found_inf, absmax) pairs to the pure rule; return [(S, e, tracker)] after each."""
    S = torch.tensor(S0, dtype=torch.float32)
    e = torch.zeros(())
    n = torch.zeros((), dtype=torch.int32)
    t = torch.zeros((), dtype=torch.int32)
    c = torch.zeros(())
    out = []
    for found, G in steps:
        max_ema_update_(S, e, n, t, c, torch.tensor(float(found)), torch.tensor(float(G)),
                        32768.0, decay, 2.0, 0.5, interval, round_pow2, grow_on_zero, cap)
        out.append((S.item(), e.item(), int(t.item())))
    return out


# (found_inf, G) -> (S, e) by hand, target 32768, d = 0.5, growth 2, backoff 0.5, interval 1.
TABLE = [
    # EMA start: e = c = 32768 / 8 = 4096 < S/2 -> back off, one halving per step, until S/2 <= e.
    ((0, 8.0), (32768.0, 4096.0)),
    ((0, 8.0), (16384.0, 4096.0)),
    ((0, 8.0), (8192.0, 4096.0)),
    ((0, 8.0), (4096.0, 4096.0)),      # 4096 is neither > 8192 nor < 2048: S = e
    ((0, 4.0), (6144.0, 6144.0)),      # c = 8192, e = (4096 + 8192) / 2, within limits: S = e
    ((1, INF), (3072.0, 6144.0)),      # non-finite: skip, back off, EMA not fed
    ((0, 0.5), (6144.0, 35840.0)),     # c = 65536, e = 3072 + 32768 > 2S: growth capped at 2S
    ((0, 0.0), (12288.0, 35840.0)),    # all-zero grads: EMA not fed, read as underflow: grow
    ((0, 1.0), (24576.0, 34304.0)),    # e = 17920 + 16384 > 2S: capped
    ((0, 1.0), (33536.0, 33536.0)),    # e = 17152 + 16384 within limits: S = e
]


def test_rule_trajectory_table() -> None:
    got = run_rule([i for i, _ in TABLE], S0=65536.0)
    assert [(s, e) for s, e, _ in got] == [o for _, o in TABLE]


def test_growth_interval_delays_growth_after_an_overflow_only() -> None:
    # interval 3: S may rise only once 3 finite steps in a row have been seen (the count starts
    # at 0, so not on step 1 either); the EMA keeps being fed meanwhile.
    got = run_rule([(0, 1.0), (1, INF), (0, 1.0), (0, 1.0), (0, 1.0), (0, 64.0)], S0=8192.0, interval=3)
    assert [s for s, _, _ in got] == [8192.0, 4096.0, 4096.0, 4096.0, 8192.0, 16384.0]
    assert [t for _, _, t in got] == [1, 0, 1, 2, 3, 3]  # saturates at the interval
    assert got[-1][1] == 16384.0 + 256.0  # c = 512 fed: e = (32768 + 512) / 2


def test_zero_grads_keep_and_pow2_rounding() -> None:
    got = run_rule([(0, 0.0), (0, 3.0), (0, 3.0)], S0=1000.0, grow_on_zero=False, round_pow2=True)
    # zero: keep (1000 -> rounded down to 512); c = 10922.67 -> capped 1024; e = c -> S = 2048.
    assert [s for s, _, _ in got] == [512.0, 1024.0, 2048.0]


def test_rejects_a_non_finite_or_zero_scale() -> None:
    fmax = torch.finfo(torch.float32).max
    got = run_rule([(0, 0.0)], S0=fmax)  # growth would overflow float32: S kept
    assert got[0][0] == fmax
    got = run_rule([(1, INF)], S0=float(torch.finfo(torch.float32).smallest_normal) * 2**-23)
    assert got[0][0] > 0  # backing off the smallest subnormal would give 0: S kept


def test_cap_ema_on_overflow_stops_the_regrowth_after_a_backoff() -> None:
    # d = 0.99. The EMA sits at 131072 (= S * 2 after the first step); an overflow backs S off.
    steps = [(0, 0.25), (1, INF), (0, 0.25)]
    seed = run_rule(steps, S0=65536.0, decay=0.99)
    # The seed's rule: the EMA is untouched, so S jumps straight back to where it overflowed.
    assert [(s, e) for s, e, _ in seed] == [(131072.0, 131072.0), (65536.0, 131072.0), (131072.0, 131072.0)]
    capped = run_rule(steps, S0=65536.0, decay=0.99, cap=True)
    e3 = 0.99 * 65536.0 + 0.01 * 131072.0  # the EMA restarts from the backed-off S
    assert capped[1][:2] == (65536.0, 65536.0)
    assert capped[2][0] == pytest.approx(e3, rel=1e-7) and capped[2][1] == pytest.approx(e3, rel=1e-7)


def test_round_down_pow2_exact() -> None:
    x = torch.tensor([1.0, 3.0, 4.0, 0.75, 1e-40, 2.0**100 * 1.999])
    assert round_down_pow2(x).tolist() == [1.0, 2.0, 4.0, 0.5, 2.0**-133, 2.0**100]


# --------------------------------------------------------------------- the strategy end to end
def drive(s, rows: list[float | None]) -> list[dict[str, float]]:
    """One parameter vector whose unscaled gradient has abs-max G (None: poison with inf)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for G in rows:
        opt.zero_grad()
        coeff = torch.tensor([0.0 if G is None else G, 0.0, 0.0])
        with forbid_host_sync():
            s.scale((p * coeff).sum() + 0.0).backward()
        if G is None:
            p.grad[1] = INF
        with forbid_host_sync():
            s.unscale_(opt)
        s.step(opt)
        with forbid_host_sync():
            s.update()
            t = s.telemetry()
        out.append({k: v.item() for k, v in t.items()})
    return out


def test_strategy_follows_the_table() -> None:
    s = strategies.create("max_ema", init_scale=65536.0, ema_decay=0.5)
    rows = [None if math.isinf(G) else G for (_, G), _ in TABLE]
    got = drive(s, rows)
    for (_, (S, e)), tel in zip(TABLE, got):
        # Unscaling multiplies by fl(1/S), so abs-max (and the candidate) may differ by an ulp.
        assert tel["scale"] == pytest.approx(S, rel=1e-6)
        assert tel["ema"] == pytest.approx(e, rel=1e-6)
    assert got[5]["found_inf"] == 1.0 and got[-1]["skipped_steps"] == 1


def test_default_decay_ema_start_and_outlier_visible_in_telemetry() -> None:
    s = strategies.create("max_ema")  # defaults: S0 = 2^15, d = 0.99, target 32768
    got = drive(s, [0.25, 0.25, 0.25, 25.0])
    assert got[0]["ema"] == 131072.0 and got[0]["ema_steps"] == 1  # EMA starts at the candidate
    assert [g["scale"] for g in got[:3]] == [65536.0, 131072.0, 131072.0]
    out = got[3]
    # The outlier: candidate collapses 100x, the EMA moves by 1 % of the gap; all three visible.
    assert out["grad_absmax"] == 25.0
    assert out["candidate"] == pytest.approx(32768.0 / 25.0)
    assert out["ema"] == pytest.approx(0.99 * 131072.0 + 0.01 * 32768.0 / 25.0, rel=1e-6)


def test_state_round_trip_keeps_the_ema() -> None:
    s = strategies.create("max_ema", ema_decay=0.9)
    drive(s, [1.0, 2.0])
    s2 = strategies.create("max_ema", ema_decay=0.9)
    s2.load_state_dict(s.state_dict())
    a, b = drive(s, [0.5, 4.0]), drive(s2, [0.5, 4.0])
    assert [x["scale"] for x in a] == [x["scale"] for x in b]
    assert [x["ema"] for x in a] == [x["ema"] for x in b]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(target_max=70000.0), "target_max must be <= format_max (65504), got 70000.0"),
        (dict(target_max=0.0), "target_max must be finite and > 0, got 0.0"),
        (dict(format_max=math.inf), "format_max must be finite and > 0, got inf"),
        (dict(ema_decay=1.0), "ema_decay must be in [0, 1), got 1.0"),
        (dict(zero_grads="shrink"), "zero_grads must be one of 'grow', 'keep', got 'shrink'"),
        (dict(round_pow2=1), "round_pow2 must be a bool, got 1"),
        (dict(cap_ema_on_overflow="yes"), "cap_ema_on_overflow must be a bool, got 'yes'"),
    ],
)
def test_invalid_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("max_ema", **kwargs)
    assert str(e.value) == message


def test_target_max_49152_allowed_for_fp16() -> None:
    strategies.create("max_ema", target_max=49152.0)
