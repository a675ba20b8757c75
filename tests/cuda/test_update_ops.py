"""Each update op (CPU twin of the CUDA update kernels, sharing cuda/include/scalelab_rules.h)
equals its strategy's pure-torch update function, bit for bit, over long random trajectories."""

from __future__ import annotations

import itertools

import pytest
import torch

from strategies.rules.max_ema import max_ema_update_
from strategies.rules.native import native_update_
from strategies.rules.norm_ratio import norm_ratio_update_
from tests.cuda.trajectories import NORM_RATIO_CASES, STEPS, assert_states_equal, bits_equal, random_absmax

# H == 1: torch's own kernel is the reference; H > 1: the Python twin, which like torch and the op
# evaluates S * factor in double and rounds once to float32 (non-power-of-two factors included).
NATIVE_CASES = list(
    itertools.product([1, 2, 4], [(2.0, 0.5), (1.1, 0.9), (1.5, 0.3), (4.0, 0.25)], [1, 3], [0.05, 0.5])
)


@pytest.mark.parametrize("hysteresis,factors,interval,p_inf", NATIVE_CASES)
def test_native_update_matches_reference(ops, hysteresis, factors, interval, p_inf):
    growth, backoff = factors
    gen = torch.Generator().manual_seed(hysteresis * 100 + interval)
    state = (torch.tensor(2.0**120), torch.tensor(0, dtype=torch.int32), torch.tensor(hysteresis, dtype=torch.int32))
    ref = tuple(t.clone() for t in state)
    twin = tuple(t.clone() for t in state)
    flags = (torch.rand(STEPS, generator=gen) < p_inf).float()
    for i in range(STEPS):
        f = flags[i].reshape(())
        ops.native_update_(*state, f, growth, backoff, interval, hysteresis)
        if hysteresis == 1:  # torch's own kernel is the reference (and the twin equals it)
            torch._amp_update_scale_(ref[0], ref[1], f, growth, backoff, interval)
            ref[2].fill_(1)
            native_update_(*twin, f, growth, backoff, interval, hysteresis)
            assert_states_equal(i, twin[:2], ref[:2])
        else:
            native_update_(*ref, f, growth, backoff, interval, hysteresis)
        if hysteresis == 1:
            state[2].fill_(1)
        assert_states_equal(i, state, ref)


def test_native_update_rejects_non_finite_growth(ops):
    s, t, h = torch.tensor(2.0**127), torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    ops.native_update_(s, t, h, torch.tensor(0.0), 2.0, 0.5, 1, 1)
    assert s.item() == 2.0**127 and t.item() == 0


MAX_EMA_CASES = [
    # target_max, decay, growth, backoff, interval, round_pow2, grow_on_zero, groups
    (32768.0, 0.99, 2.0, 0.5, 1, False, True, 1),
    (49152.0, 0.0, 2.0, 0.5, 1, True, False, 1),
    (1000.3, 0.7, 1.5, 0.8, 4, False, False, 1),
    (32768.0, 0.9, 2.0, 0.5, 3, True, True, 5),  # layerwise-style: per-group, power-of-two scales
    (65504.0, 0.5, 1.1, 0.9, 2, False, True, 3),
]


@pytest.mark.parametrize("case", MAX_EMA_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("broadcast_found", [False, True])
@pytest.mark.parametrize("cap", [False, True], ids=["seed_rule", "cap_ema"])
def test_max_ema_update_matches_reference(ops, case, broadcast_found, cap):
    target, decay, growth, backoff, interval, pow2, grow0, G = case
    gen = torch.Generator().manual_seed(G * 7 + interval)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    state = (torch.full((G,), 2.0**15, **f32), torch.zeros(G, **f32), torch.zeros(G, **i32),
             torch.zeros(G, **i32), torch.full((G,), float("nan"), **f32))
    ref = tuple(t.clone() for t in state)
    other = tuple(t.clone() for t in state)  # the opposite cap option: shows the option acts
    differed = False
    for i in range(STEPS):
        absmax = random_absmax(gen, G)
        found = (~torch.isfinite(absmax)).float()
        found = found.amax().reshape(()) if broadcast_found else found
        args = (found, absmax, target, decay, growth, backoff, interval, pow2, grow0)
        ops.max_ema_update_(*state, *args, cap)
        max_ema_update_(*ref, *args, cap)
        assert_states_equal(i, state, ref)
        max_ema_update_(*other, *args, not cap)
        differed |= not torch.equal(other[1], ref[1])
    assert (state[2] > 0).all(), "trajectory never fed the EMA: the test would not test it"
    assert differed, "cap_ema_on_overflow never changed the EMA: the test would not test it"


@pytest.mark.parametrize("growth", [1.5, 3.0, 2.0])
def test_max_ema_drop_threshold_is_a_multiplication_by_the_reciprocal(ops, growth):
    """"e below S / growth" is e < S * float32(1 / growth) in the op and in the twin (torch on CUDA
    divides by a host scalar that way): EMAs placed between the true quotient and that product
    take the same branch in both. For growth 2 the two are the same number (nothing changed)."""
    gen = torch.Generator().manual_seed(int(growth * 10))
    s = torch.exp2(torch.empty(4000).uniform_(-60, 60, generator=gen)) * (1 + torch.rand(4000, generator=gen))
    s = torch.cat([s, torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-126 * 1.5])])  # subnormal thresholds
    by_mul, by_div = s * (1.0 / growth), s / growth
    if growth == 2.0:
        assert torch.equal(by_mul, by_div)
        return
    apart = by_mul != by_div
    assert apart.sum() > 100, "no scale where the two thresholds differ: the test would not test it"
    S = s[apart]
    G = S.numel()
    e = torch.minimum(by_mul, by_div)[apart]
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    # ema_decay 1 keeps e as given (fed with candidate 1/1 = 1 at weight 0); interval 1: may grow.
    state = (S.clone(), e.clone(), torch.ones(G, **i32), torch.zeros(G, **i32), torch.zeros(G, **f32))
    ref = tuple(t.clone() for t in state)
    args = (torch.zeros(G), torch.ones(G), 1.0, 1.0, growth, 0.5, 1, False, True, False)
    ops.max_ema_update_(*state, *args)
    max_ema_update_(*ref, *args)
    assert_states_equal(0, state, ref)
    want = torch.where(e < S * torch.tensor(1.0 / growth, dtype=torch.float32), S * 0.5, e)
    assert bits_equal(state[0], want)
    true_division = torch.where(e < S / growth, S * 0.5, e)
    assert not torch.equal(want, true_division), "the cases do not separate the two thresholds"


@pytest.mark.parametrize("case", NORM_RATIO_CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_ratio_update_matches_reference(ops, case):
    """Scale, tracker and probe count bit for bit; the ratio and its log-EMA to 1e-6, because
    torch's CPU sqrt/log2 go through MKL's vector math (not correctly rounded: measured 1 ulp
    off IEEE sqrt) while the op uses IEEE sqrt and libm's log2f."""
    growth, backoff, interval, hi, lo, decay = case
    gen = torch.Generator().manual_seed(interval)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    state = (torch.tensor(2.0**16), torch.tensor(0, **i32), torch.tensor(0.0), torch.tensor(0, **i32),
             torch.tensor(float("nan")))
    ref = tuple(t.clone() for t in state)
    acted = 0
    for i in range(STEPS):
        ref_ss, mp_ss = random_absmax(gen, 2).square()
        mp_ss = mp_ss * torch.exp2(torch.randint(-12, 13, (), generator=gen).float())  # ratios around 1
        found = torch.tensor(float(torch.rand((), generator=gen) < 0.1))
        probed = bool(torch.rand((), generator=gen) < 0.5)
        args = (found, ref_ss.reshape(()), mp_ss.reshape(()), probed, growth, backoff, interval, hi, lo, decay)
        before = state[0].clone()
        ops.norm_ratio_update_(*state, *args)
        norm_ratio_update_(*ref, *args)
        assert_states_equal(i, (state[0], state[1], state[3]), (ref[0], ref[1], ref[3]))
        torch.testing.assert_close(state[2], ref[2], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[4], ref[4], rtol=1e-6, atol=0, equal_nan=True)
        acted += int(probed and state[1].item() == 0 and state[0].item() != before.item())
    assert acted > 0 and state[3].item() > 0, "no probe moved the scale: the test would not test it"


LAYERWISE_CASES = [
    # rule, growth, backoff, interval, grow_on_zero, min_scale, max_scale, groups
    ("max_ema", 2.0, 0.5, 1, True, None, None, 4),
    ("max_ema", 4.0, 0.25, 3, False, 2.0**-4, 2.0**20, 6),
    ("backoff_growth", 2.0, 0.5, 2, True, None, None, 5),
    ("backoff_growth", 2.0, 0.5, 1, True, 1.0, 2.0**18, 3),
]


@pytest.mark.parametrize("case", LAYERWISE_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("cap", [False, True], ids=["seed_rule", "cap_ema"])
def test_layerwise_update_matches_reference(ops, case, cap):
    from strategies.rules.layerwise import layerwise_update_

    rule, growth, backoff, interval, grow0, lo, hi, G = case
    gen = torch.Generator().manual_seed(G + interval)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    state = (torch.full((G,), 2.0**15, **f32), torch.zeros(G, **i32), torch.zeros(G, **f32), torch.zeros(G, **i32),
             torch.ones(G, **i32), torch.zeros(G, **f32), torch.zeros(G, **f32))
    ref = tuple(t.clone() for t in state)
    skipped = blamed_some = 0
    for i in range(STEPS):
        absmax = random_absmax(gen, G)
        group_found = (~torch.isfinite(absmax)).float()
        emitted = (torch.rand(G, generator=gen) < 0.05).float()
        contaminated = (torch.rand(G, generator=gen) < 0.1).float()
        found = torch.maximum(group_found.amax(), emitted.amax()).reshape(())
        numel = torch.randint(0, 3, (G,), generator=gen) * 1000  # some groups got no gradient
        args = (found, group_found, absmax, numel, emitted, contaminated,
                rule, 32768.0, 0.9, growth, backoff, interval, grow0, lo, hi)
        ops.layerwise_update_(*state, *args, cap)
        layerwise_update_(*ref, *args, cap)
        assert_states_equal(i, state, ref)
        skipped += int(found.item() > 0)
        blamed_some += int(found.item() > 0 and state[6].sum().item() < G)
    assert skipped > 0 and blamed_some > 0, "no attributed overflow: the test would not test attribution"


def test_layerwise_rejects_unknown_rule(ops):
    z = torch.zeros(2)
    zi = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="rule must be one of"):
        ops.layerwise_update_(z.clone(), zi.clone(), z.clone(), zi.clone(), zi.clone(), z.clone(), z.clone(),
                              torch.tensor(0.0), z, z, torch.zeros(2, dtype=torch.int64), z, z,
                              "nope", 1.0, 0.5, 2.0, 0.5, 1, True, None, None)
