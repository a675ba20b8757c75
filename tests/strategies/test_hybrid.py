"""`hybrid`: the pure rule against a hand-computed table (every branch), the zero-jump trigger end
to end without host reads, and `max_ema` exactly when no reference is given."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.rules.hybrid import HybridParams, hybrid_hparams, hybrid_update_
from tests.helpers import batch, forbid_host_sync, mlp, params_equal
from tests.strategies.drivers import fp16_run

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny fp16-autocast models: one thread (conftest.py)

INF = math.inf


def run_rule(rows, S0=4096.0, **kw):
    """rows: (probed, scheduled, found_inf, G, zero_frac, ref_sumsq, mp_sumsq)
    -> [(S, e, ema_steps, zero_jumped, calibrations, ratio_steps)] after each update."""
    p = HybridParams(ema_decay=0.5, **kw)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    S, e, n, t, c = torch.tensor(S0), torch.zeros(()), torch.zeros((), **i32), torch.zeros((), **i32), torch.zeros(())
    m, k, r = torch.zeros(()), torch.zeros((), **i32), torch.full((), math.nan)
    cal, zprev, zj = torch.zeros((), dtype=torch.int64), torch.ones(()), torch.zeros(())
    out = []
    for probed, scheduled, found, G, z, ref, mp in rows:
        args = [torch.tensor(float(x), **f32) for x in (found, G, z, ref, mp)]
        hybrid_update_(S, e, n, t, c, m, k, r, cal, zprev, zj, *args, probed, scheduled, *hybrid_hparams(p))
        out.append((S.item(), e.item(), int(n.item()), zj.item(), int(cal.item()), int(k.item())))
    return out


# max rule: target 32768, EMA d = 0.5, growth 2, backoff 0.5, interval 1 (candidate c = 32768 / G);
# probe: thresholds 8 and 1/8, no ratio EMA (m = log2 r); zero_jump 0.1 (z_{-1} = 1).
# (probed, scheduled, found, G, z, ref_sumsq, mp_sumsq) -> (S, e, ema_steps, jumped, calibrations, valid probes)
TABLE = [
    # scheduled; all-zero grads: the max rule grows 4096 -> 8192 with the EMA not fed (e = 0, not
    # started); the probe (||g_mp|| = 0, log2 r clamped to 16 > 3) says x2 from S = 4096 -> 8192 and
    # re-seeds the EMA there, marked started.
    ((True, True, 0, 0.0, 1.0, 1.0, 0.0), (8192.0, 8192.0, 1, 0.0, 1, 1)),
    # not scheduled, z falls (no jump): r = 16 but the probe does not act; the max rule blends
    # c = 4096 into the re-seeded EMA: e = (8192 + 4096) / 2 = 6144, within [4096, 16384] -> S = e.
    # (Without the re-seed the EMA would start at c = 4096 and S would be 4096.)
    ((True, False, 0, 8.0, 0.0, 256.0, 1.0), (6144.0, 6144.0, 2, 0.0, 1, 1)),
    # not scheduled, z jumps 0 -> 0.5 > 0.1: the probe acts, r = 16 -> x2 from 6144 = 12288, EMA
    # re-seeded (the max rule alone: e = 5120 -> S = 5120).
    ((True, False, 0, 8.0, 0.5, 256.0, 1.0), (12288.0, 12288.0, 3, 1.0, 2, 2)),
    # z rises by 0.05 only: no jump, the probe's r = 16 is ignored; e = (12288 + 4096) / 2 = 8192.
    ((True, False, 0, 8.0, 0.55, 256.0, 1.0), (8192.0, 8192.0, 4, 0.0, 2, 2)),
    # scheduled, r = 1/64 (log2 -6 < -3): x0.5 from 8192 -> 4096, EMA re-seeded (max rule: c = 8192,
    # e = 8192 -> S = 8192).
    ((True, True, 0, 4.0, 0.55, 1.0, 4096.0), (4096.0, 4096.0, 5, 0.0, 3, 3)),
    # scheduled with non-finite gradients (and a jump): the probe is discarded; skip + backoff,
    # EMA not fed.
    ((True, True, 1, INF, 0.9, 256.0, 1.0), (2048.0, 4096.0, 5, 1.0, 3, 3)),
    # scheduled, r = 1: a valid probe that keeps S; the max rule stands: e = 4096 = 2S -> S = e.
    ((True, True, 0, 8.0, 0.9, 1.0, 1.0), (4096.0, 4096.0, 6, 0.0, 3, 4)),
    # scheduled, both norms 0: no information, the max rule stands.
    ((True, True, 0, 8.0, 0.9, 0.0, 0.0), (4096.0, 4096.0, 7, 0.0, 3, 4)),
    # no reference this step: the max rule alone.
    ((False, True, 0, 8.0, 0.8, 0.0, 0.0), (4096.0, 4096.0, 8, 0.0, 3, 4)),
    # no reference, z jumps 0.8 -> 0.95: recorded, nothing to act on; c = 16384, e = 10240 > 2S:
    # growth capped at 8192.
    ((False, False, 0, 2.0, 0.95, 0.0, 0.0), (8192.0, 10240.0, 9, 1.0, 3, 4)),
]


def test_rule_trajectory_table() -> None:
    got = run_rule([row for row, _ in TABLE])
    assert got == [want for _, want in TABLE]


def test_zero_jump_off_never_triggers_and_the_ratio_ema_smooths_calibrations() -> None:
    rows = [(True, False, 0, 8.0, 0.0, 256.0, 1.0), (True, False, 0, 8.0, 1.0, 256.0, 1.0)]
    got = run_rule(rows, zero_jump=None)
    assert [g[3] for g in got] == [0.0, 0.0] and [g[4] for g in got] == [0, 0]  # no jump, no calibration
    # ratio_ema_decay 0.5: log2 r = 4, then -2: m = 4 (> 3, x2), then (4 - 2) / 2 = 1 (keep).
    rows = [(True, True, 0, 8.0, 0.0, 256.0, 1.0), (True, True, 0, 8.0, 0.0, 1.0, 16.0)]
    got = run_rule(rows, S0=4096.0, ratio_ema_decay=0.5)
    assert [g[4] for g in got] == [1, 1]
    assert got[0][0] == 8192.0 and got[1][0] == 6144.0  # second step: the max rule, e = (8192 + 4096) / 2


# --------------------------------------------------------------------- end to end
def drive(s, rows, ratio: float = 16.0):
    """A 10-entry parameter whose unscaled gradient has abs-max G with ``zeros`` exact zeros, and
    an fp32 reference whose gradient is ``ratio`` times larger (so r = ratio on every probe)."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.0)
    coeff = torch.zeros(10)
    s.set_reference(lambda: (p * coeff).sum() * ratio)
    out = []
    for G, zeros in rows:
        coeff.copy_(torch.tensor([G] * (10 - zeros) + [0.0] * zeros))
        opt.zero_grad()
        with forbid_host_sync():
            s.scale((p * coeff).sum()).backward()
            s.unscale_(opt)
        s.step(opt)
        with forbid_host_sync():
            s.update()
            t = s.telemetry()
        out.append({k: v.item() for k, v in t.items()})
    return out


def test_a_zero_fraction_jump_calibrates_on_the_device_without_a_host_read() -> None:
    # r = 16 on every reference, but only the scheduled step 0 and the jump at step 3 (0 -> 50 %
    # zeros) may act; the reference itself runs every step (the price of the device-side trigger).
    s = strategies.create("hybrid", init_scale=4096.0, ema_decay=0.5, probe_interval=1000)
    got = drive(s, [(8.0, 0), (8.0, 0), (8.0, 0), (8.0, 5), (8.0, 5)])
    assert [g["zero_jumped"] for g in got] == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert [g["calibrations"] for g in got] == [1, 1, 1, 2, 2]
    assert [g["probe_count"] for g in got] == [1, 2, 3, 4, 5]
    assert all(g["norm_ratio"] == pytest.approx(16.0) for g in got)
    # S by hand (c = 4096): 0: probe x2 -> 8192, e := 8192; 1: e = 6144 -> S; 2: e = 5120 -> S;
    # 3: the jump's probe x2 -> 10240, e := 10240; 4: e = 7168 -> S.
    assert [g["scale"] for g in got] == pytest.approx([8192.0, 6144.0, 5120.0, 10240.0, 7168.0], rel=1e-6)
    assert got[3]["ema"] == pytest.approx(10240.0, rel=1e-6)

    off = strategies.create("hybrid", init_scale=4096.0, ema_decay=0.5, probe_interval=1000, zero_jump=None)
    got = drive(off, [(8.0, 0), (8.0, 0), (8.0, 0), (8.0, 5), (8.0, 5)])
    assert [g["calibrations"] for g in got] == [1, 1, 1, 1, 1]
    assert [g["probe_count"] for g in got] == [1, 1, 1, 1, 1]  # the reference runs on the schedule only


def test_a_resumed_run_keeps_the_trigger_and_probe_state() -> None:
    # The previous zero fraction is saved: resumed after a step with no zeros, the next step's
    # 50 % zeros is a jump in both runs (a fresh z_prev = 1 would hide it); the calibration count
    # and the ratio EMA carry over, and both runs go on identically.
    kw = dict(init_scale=4096.0, ema_decay=0.5, probe_interval=1000, ratio_ema_decay=0.5)
    s = strategies.create("hybrid", **kw)
    drive(s, [(8.0, 0), (8.0, 0)])
    sd = s.state_dict()
    assert sd["extra"]["zero_frac_prev"] == 0.0 and sd["extra"]["calibrations"] == 1
    s2 = strategies.create("hybrid", **kw)
    s2.load_state_dict(sd)
    a, b = drive(s, [(8.0, 5), (8.0, 5)]), drive(s2, [(8.0, 5), (8.0, 5)])
    timing = ("probe_time_s", "probe_last_time_s")  # host wall time: not state
    assert [{k: x for k, x in t.items() if k not in timing} for t in a] == \
        [{k: x for k, x in t.items() if k not in timing} for t in b]
    assert [t["zero_jumped"] for t in b] == [1.0, 0.0] and b[-1]["calibrations"] == 2


def test_without_a_reference_it_warns_once_and_is_max_ema() -> None:
    kw = dict(init_scale=2.0**12, ema_decay=0.9)
    mult = lambda step: 1e-4 if step < 6 else 1.0  # noqa: E731  (grow, then a drop: every branch)
    with pytest.warns(UserWarning, match="hybrid: no reference closure") as rec:
        m1, hybrid = fp16_run(strategies.create("hybrid", probe_interval=2, **kw), 12, closure=False,
                              multiplier=mult, poison_at=(4,))
    assert len([w for w in rec if "no reference closure" in str(w.message)]) == 1
    m2, max_ema = fp16_run(strategies.create("max_ema", **kw), 12, closure=False, multiplier=mult, poison_at=(4,))
    for key in ("scale", "ema", "ema_steps", "growth_tracker", "candidate", "skipped_steps"):
        assert [t[key] for t in hybrid] == [t[key] for t in max_ema], key
    assert params_equal(m1, m2)
    assert hybrid[-1]["probe_count"] == 0 and hybrid[-1]["calibrations"] == 0
    assert len({t["scale"] for t in hybrid}) > 4  # the trajectory really moves


def test_an_fp16_underflow_is_a_zero_jump_that_calibrates_that_step() -> None:
    # A healthy fp16 run; at step 5 the loss shrinks by 2^-40: every activation gradient flushes to
    # zero, the zero fraction jumps 0 -> 1, and the reference (r clamped to 2^16) calibrates x2 at
    # that step -- not a scheduled one (probe_interval 1000) -- re-seeding the EMA at the new S.
    s = strategies.create("hybrid", init_scale=2.0**10, probe_interval=1000)
    _, tel = fp16_run(s, 7, closure=True, multiplier=lambda step: 2.0**-40 if step >= 5 else 1.0)
    assert [t["grad_zero_frac"] for t in tel][4:] == [0.0, 1.0, 1.0]
    assert [t["zero_jumped"] for t in tel] == [0.0] * 5 + [1.0, 0.0]
    assert [t["calibrations"] for t in tel] == [0] * 5 + [1, 1]
    assert tel[5]["norm_ratio"] == INF
    assert tel[5]["scale"] == 2 * tel[4]["scale"] and tel[5]["ema"] == tel[5]["scale"]
    assert tel[6]["scale"] == 2 * tel[5]["scale"]  # no jump (1 -> 1): the max rule's all-zero growth
    assert tel[6]["ema"] == tel[5]["ema"]  # all-zero gradients do not feed the EMA


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(probe_interval=0), "probe_interval must be an integer >= 1, got 0"),
        (dict(threshold_high=0.1), "threshold_high must be > threshold_low (0.125), got 0.1"),
        (dict(threshold_low=-1.0), "threshold_low must be finite and > 0, got -1.0"),
        (dict(probe_layers="0"), "probe_layers must be a list of fnmatch patterns (strings) or None, got '0'"),
        (dict(ratio_ema_decay=1.0), "ratio_ema_decay must be in [0, 1), got 1.0"),
        (dict(zero_jump=0.0), "zero_jump must be in (0, 1), got 0.0"),
        (dict(zero_jump="big"), "zero_jump must be a real number, got 'big'"),
        (dict(target_max=70000.0), "target_max must be <= format_max (65504), got 70000.0"),
        (dict(ema_decay=1.0), "ema_decay must be in [0, 1), got 1.0"),
        (dict(zero_grads="shrink"), "zero_grads must be one of 'grow', 'keep', got 'shrink'"),
        (dict(round_pow2=1), "round_pow2 must be a bool, got 1"),
        (dict(cap_ema_on_overflow="yes"), "cap_ema_on_overflow must be a bool, got 'yes'"),
    ],
)
def test_invalid_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("hybrid", **kwargs)
    assert str(e.value) == message
