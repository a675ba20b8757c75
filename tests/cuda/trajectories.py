"""Long random trajectories of every update op's arguments, and the bit-exact comparison of an
op's state with its Python twin's: shared by the CPU-twin tests (test_update_ops.py,
test_update_trajectories.py), the GPU tests (test_gpu_cases.py, test_gpu_trajectories.py) and the special-value
tests (test_found_inf.py, test_nan_bits.py, test_many_groups.py)."""

from __future__ import annotations

import math

import torch

from strategies.rules.adaloss import adaloss_step_, quantile
from strategies.rules.amax_history import amax_history_update_
from strategies.formats import FP16_MIN_NORMAL
from strategies.rules.hybrid import hybrid_update_
from strategies.rules.learned import learned_update_
from strategies.rules.tolerance import tolerance_update_
from strategies.rules.underflow_target import E_BINS, E_LO, underflow_target_update_

STEPS = 400

def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)

def assert_states_equal(step: int, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for k, (g, w) in enumerate(zip(got, want)):
        assert bits_equal(g, w), f"step {step}, state {k}: op {g.tolist()} != reference {w.tolist()}"

def random_absmax(gen: torch.Generator, n: int) -> torch.Tensor:
    """Log-uniform magnitudes over 2^-40..2^40 with some 0, +inf and NaN (the pass's outputs)."""
    x = torch.exp2(torch.empty(n).uniform_(-40, 40, generator=gen))
    u = torch.rand(n, generator=gen)
    x[u < 0.05] = 0.0
    x[(u >= 0.05) & (u < 0.08)] = float("inf")
    x[(u >= 0.08) & (u < 0.10)] = float("nan")
    return x

NORM_RATIO_CASES = [
    # growth, backoff, interval, th_high, th_low, decay
    (2.0, 0.5, 2000, 8.0, 0.125, 0.5),
    (2.0, 0.5, 3, 8.0, 0.125, 0.0),
    (1.5, 0.7, 5, 3.7, 0.3, 0.9),
]


F32, I32, I64 = dict(dtype=torch.float32), dict(dtype=torch.int32), dict(dtype=torch.int64)

def step_found(gen: torch.Generator, absmax: torch.Tensor) -> torch.Tensor:
    """found_inf as the statistics pass gives it (any non-finite abs-max), plus a few overflows
    that the abs-max does not show (another optimizer's, or a skipped step's)."""
    return torch.tensor(float((~torch.isfinite(absmax)).any() or torch.rand((), generator=gen) < 0.03))

def run_pair(op, twin, state: tuple[torch.Tensor, ...], steps, hyper: tuple) -> tuple[torch.Tensor, ...]:
    """Run op and twin from the same state over `steps` (argument tuples), compare every step."""
    ref = tuple(t.clone() for t in state)
    for i, args in enumerate(steps):
        op(*state, *args, *hyper)
        twin(*ref, *args, *hyper)
        assert_states_equal(i, state, ref)
    return state

AMAX_CASES = [
    # history_len, most_recent, format_max, margin, backoff, groups
    (1024, False, 65504.0, 0.0, 0.5, 1),
    (16, False, 65504.0, 3.0, 0.7, 3),
    (1, False, 448.0, 0.0, 0.5, 1),
    (8, True, 57344.0, 1.0, 0.25, 2),
    (1000, False, 65504.0, 1.0, 0.5, 200),  # a history that is not a multiple of the CUDA block, many groups
]

def amax_history_trajectory(case):
    """(state, per-step arguments, hyper-parameters, check of the final state). Overflowed steps
    record format_max / S; the abs-max spans 2^-40..2^40, so some records are subnormal or
    non-finite bounds (S far from the gradients) and the scale is kept."""
    L, recent, format_max, margin, backoff, G = case
    gen = torch.Generator().manual_seed(L + G)
    steps = []
    for _ in range(STEPS):
        absmax = random_absmax(gen, G)
        if G > 3:  # finite groups and one special one: clean steps stay common
            absmax = torch.cat([torch.exp2(torch.empty(G - 1).uniform_(-40, 40, generator=gen)), absmax[:1]])
        steps.append((step_found(gen, absmax), absmax))

    def check(state):
        assert (state[1] > 0).any() and state[0].item() != 2.0**15, "the history never placed S"

    hyper = (format_max, format_max * 2.0**-margin, backoff, recent)
    return (torch.tensor(2.0**15), torch.zeros(L)), steps, hyper, check

HYBRID_CASES = [
    # round_pow2, cap, zero_jump, ratio_ema_decay, growth, backoff, interval
    (False, False, 0.1, 0.0, 2.0, 0.5, 1),
    (True, True, 0.05, 0.5, 2.0, 0.5, 3),
    (False, True, None, 0.9, 1.5, 0.7, 2),
]

def hybrid_trajectory(case):
    pow2, cap, zero_jump, ratio_decay, growth, backoff, interval = case
    gen = torch.Generator().manual_seed(interval)
    # first: all-zero gradients (EMA not fed) and a calibration that acts, so the re-seed starts the EMA
    steps, z = [(torch.tensor(0.0), torch.zeros(2), torch.tensor(0.5), torch.tensor(256.0), torch.tensor(1.0),
                 True, True)], 0.5
    for _ in range(STEPS):
        absmax = random_absmax(gen, 2)
        r = torch.rand(4, generator=gen)
        z = float(r[0]) if r[1] < 0.2 else min(1.0, max(0.0, z + 0.02 * float(r[2] - 0.5)))
        ref_ss = torch.exp2(torch.empty(()).uniform_(-40, 40, generator=gen))
        mp_ss = ref_ss * torch.exp2(torch.randint(-12, 13, (), generator=gen).float())
        ref_ss = torch.tensor(0.0) if r[3] < 0.03 else ref_ss
        probed, scheduled = bool(torch.rand((), generator=gen) < 0.6), bool(torch.rand((), generator=gen) < 0.3)
        steps.append((step_found(gen, absmax), absmax, torch.tensor(z), ref_ss, mp_ss, probed, scheduled))
    state = (torch.tensor(2.0**15), torch.zeros(()), torch.zeros((), **I32), torch.zeros((), **I32),
             torch.full((), math.nan), torch.zeros(()), torch.zeros((), **I32), torch.full((), math.nan),
             torch.zeros((), **I64), torch.ones(()), torch.zeros(()))
    hyper = (32768.0, 0.9, growth, backoff, interval, pow2, True, cap, zero_jump, 8.0, 0.125, ratio_decay)

    def check(state):
        assert state[8].item() > 3 and state[6].item() > 10, "no calibration acted"

    return state, steps, hyper, check

LEARNED_CASES = [
    # target_max, underflow_weight, lr, beta1, beta2, eps, growth, backoff, interval
    (32768.0, 1.0, 1.0, 0.9, 0.999, 1e-8, 2.0, 0.5, 1),
    (49152.0, 0.3, 0.37, 0.5, 0.5, 1e-3, 1.7, 0.6, 3),
    (1000.3, 4.0, 3.0, 0.0, 0.9, 1e-8, 2.0, 0.5, 2),
]

def learned_trajectory(case):
    gen = torch.Generator().manual_seed(int(case[2] * 100))
    steps = []
    for _ in range(STEPS):
        absmax = random_absmax(gen, 2) * 2.0**-20  # around the target at scales 2^0..2^40
        steps.append((step_found(gen, absmax), absmax, torch.rand((), generator=gen) * 0.5))
    state = (torch.tensor(2.0**15), torch.zeros((), **I32), torch.zeros(()), torch.zeros(()),
             torch.zeros((), **I32), *(torch.full((), math.nan) for _ in range(4)))

    def check(state):
        assert state[4].item() > 100, "Adam was hardly fed"

    return state, steps, case, check

UNDERFLOW_CASES = [
    # target, target_max, smallest_normal, growth, backoff, max_shift, observed, count scale
    (1e-3, 32768.0, FP16_MIN_NORMAL, 2.0, 0.5, 32, True, 1.0),
    (0.05, 448.0, 2.0**-6, 2.0, 0.5, 4, True, 2.0**20),
    (0.0, 65504.0, 1e-5, 1.5, 0.7, 64, False, 3.0),
]

def underflow_target_trajectory(case):
    """The histogram is state the op clears; each step's arguments carry the counts to load."""
    *hyper, count_scale = case
    gen = torch.Generator().manual_seed(int(case[5]))
    steps = []
    for _ in range(STEPS):
        n = int(torch.randint(0, 4000, (), generator=gen)) if torch.rand((), generator=gen) > 0.1 else 0
        mu, sigma = float(torch.empty(()).uniform_(-40, 10, generator=gen)), float(torch.rand((), generator=gen)) * 8
        e = (torch.randn(n, generator=gen) * sigma + mu).round().long().clamp(E_LO, E_LO + E_BINS - 1)
        hist = torch.bincount(e - E_LO, minlength=E_BINS).float() * count_scale
        steps.append((hist, torch.tensor(float(torch.rand((), generator=gen) < 0.05))))

    def check(state):
        assert state[0].item() != 2.0**15 and state[1].sum() == 0, "S never placed"

    return (torch.tensor(2.0**15), torch.zeros(E_BINS)), steps, tuple(hyper), check

def load_hist(op):
    """underflow_target's step arguments start with the counts: load them into exp_hist first."""
    def run(scale, exp_hist, hist, found, *hyper):
        exp_hist.copy_(hist)
        op(scale, exp_hist, found, *hyper)
    return run

TOLERANCE_CASES = [
    # tolerance, threshold, on_min_scale (None: no floor, clamp: min_scale given, no fault), min_scale,
    # growth, backoff, interval, initial S, window_follows_scale (metaseq)
    (0.0, None, None, None, 2.0, 0.5, 3, 2.0**15, False),
    (0.25, 2.0**7.5, "clamp", 2.0**9, 2.0, 0.5, 16, 2.0**10, False),
    (1.0, None, "raise", 2.0**8, 2.0, 0.5, 2, 2.0**10, False),
    (0.25, None, "raise", 1e-4, 1.7, 0.6, 1, 2.0**120, False),
    (0.5, 3.1, None, 1e-4, 2.0, 0.5, 5, 2.0**6, False),
    (0.0, None, None, None, 2.0, 0.5, 4, 2.0**10, True),
    (0.25, None, "raise", 2.0**4, 1.7, 0.6, 3, 2.0**10, True),
]

def tolerance_trajectory(case):
    """Overflow rate switching every 40 steps among 0.02, 0.3 and 0.8, so the fraction o / r
    crosses every tolerance; interval 1 from 2^120 reaches a non-finite grown S (kept)."""
    tol, threshold, floor, min_scale, growth, backoff, interval, s0, follow = case
    gen = torch.Generator().manual_seed(int(tol * 100) + interval)
    steps, rate = [], 0.02
    for i in range(STEPS):
        if i % 40 == 0:
            rate = (0.02, 0.3, 0.8)[int(torch.randint(0, 3, (), generator=gen))]
        steps.append((torch.tensor(float(torch.rand((), generator=gen) < rate)), i + 1))
    state = (torch.tensor(s0), torch.zeros((), **I32), torch.ones((), **I64), torch.zeros((), **I64),
             torch.zeros((), **I64), torch.tensor(interval, **I64))
    hyper = (growth, backoff, interval, tol, threshold, floor == "raise", min_scale, follow)

    def check(state):
        assert state[0].item() != s0, "S never moved"
        if follow:
            assert state[5].item() != interval, "the window never moved"
        if floor == "raise" and min_scale > 1.0:
            assert state[4].item() > 0, "the floor never faulted"

    return state, steps, hyper, check

def fault_state(op):
    """tolerance's fault and window are state (cloned and compared) but sit among the
    hyper-parameters, and each step passes its number: (state..., fault, window, found, step,
    hyper..., raise, min_scale, follow)."""
    def run(scale, tracker, since, overflows, fault, window, found, step, growth, backoff, interval, tol, threshold,
            raise_, min_scale, follow):
        op(scale, tracker, since, overflows, found, growth, backoff, interval, tol, threshold,
           fault if raise_ else None, min_scale, step, window if follow else None)
    return run

ADALOSS_CASES = [
    # underflow rate, layer cap, total cap, backoff, power-of-two bounds, groups
    (1e-3, 16.0, 1024.0, 0.5, None, None, 5),
    (1e-2, 8.0, 2.0**16, 0.25, 2.0, 2.0**8, 5),
    (1e-3, 16.0, 2.0**40, 0.5, None, None, 12),
    (1e-2, 4.0, 2.0**60, 0.5, 2.0**-20, None, 48),
    (1e-4, 16.0, 1024.0, 0.5, None, 2.0**9, 200),  # more groups than the CUDA block's threads
]

def adaloss_trajectory(case):
    """G groups (group 2 without weight matrices), the hooks' statistics drawn log-uniformly
    each step (sometimes zero), and 5% skipped steps with the blame scattered over the groups and
    the skipped step's statistics non-finite."""
    rate, layer_cap, total_cap, backoff, lo, hi, G = case
    gen = torch.Generator().manual_seed(int(layer_cap) + int(1 / rate) + G)

    def u(a, b, n=G):
        return torch.empty(n).uniform_(a, b, generator=gen)

    steps = []
    for _ in range(STEPS):
        n = torch.randint(1, 10_000, (G,), generator=gen).float()
        g2 = torch.exp2(u(-70, -8)) * n * (u(0, 1) > 0.1)
        gmax = (g2 / n).sqrt() * u(2, 50) * (u(0, 1) > 0.05)
        w2, fan = torch.exp2(u(-14, 0)), torch.tensor([512.0, 64.0, 1.0, 16.0, 128.0]).repeat(G)[:G]
        wmax = w2.sqrt() * u(2, 8)
        w2[2], wmax[2] = 1.0, 1.0
        found = float(torch.rand((), generator=gen) < 0.05)
        marks = [(u(0, 1) < 0.3).float() * found for _ in range(3)]
        if found:
            g2[marks[0] > 0] = float("inf")
            gmax[marks[0] > 0] = float("nan")
        steps.append((g2, n, gmax, torch.tensor(found), *marks, w2, wmax, fan))
    state = (torch.ones(G), torch.zeros(G), torch.zeros(G), torch.zeros(G), torch.zeros(G))
    hyper = (quantile(rate), 6e-8, 65504.0, layer_cap, total_cap, backoff, lo, hi)

    def check(state):
        assert state[0].unique().numel() > 1 and state[2].sum() == 0, "AdaLoss never spread the scales"

    return state, steps, hyper, check

def load_stats(op):
    """adaloss_step_'s step arguments start with the hooks' statistics, which the op clears: load them first."""
    def run(scales, origin, g2, n, gmax, g2_in, n_in, gmax_in, *rest):
        for t, v in ((g2, g2_in), (n, n_in), (gmax, gmax_in)):
            t.copy_(v)
        op(scales, origin, g2, n, gmax, *rest)
    return run

TRAJECTORIES = {
    "amax_history_update_": (amax_history_update_, amax_history_trajectory, AMAX_CASES),
    "hybrid_update_": (hybrid_update_, hybrid_trajectory, HYBRID_CASES),
    "learned_update_": (learned_update_, learned_trajectory, LEARNED_CASES),
    "underflow_target_update_": (underflow_target_update_, underflow_target_trajectory, UNDERFLOW_CASES),
    "tolerance_update_": (tolerance_update_, tolerance_trajectory, TOLERANCE_CASES),
    "adaloss_step_": (adaloss_step_, adaloss_trajectory, ADALOSS_CASES),
}
"""op -> (Python twin, trajectory builder, cases); test_gpu_trajectories.py runs the same trajectories on CUDA."""

CASES = [(op, case) for op, (_, _, cases) in TRAJECTORIES.items() for case in cases]

def with_loader(op_name: str, fn):
    return {"underflow_target_update_": load_hist, "tolerance_update_": fault_state,
            "adaloss_step_": load_stats}.get(op_name, lambda f: f)(fn)
