"""The per-group rules at 12, 48 and 200 layer groups (more than the CUDA block's 256 threads
would need strides; 200 is near one full block): layerwise's update (rules max_ema and
backoff_growth) and AdaLoss's step, the CPU op against the Python twin bit for bit, and the CUDA
kernels (one block: a thread per group, a block-wide OR for the blame, AdaLoss's scan in one
thread) against the CPU op without a host sync (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from strategies.rules.adaloss import adaloss_step_
from strategies.rules.layerwise import layerwise_update_
from tests.cuda.gpu import no_sync
from tests.cuda.trajectories import adaloss_trajectory, assert_states_equal, load_stats

GROUPS = [12, 48, 200]
I32 = dict(dtype=torch.int32)


def layerwise_trajectory(G: int, rule: str, cap: bool):
    """(state, per-step statistics, hyper-parameters): 150 steps; 15% carry a non-finite group
    (Inf or NaN), some an emitted overflow, 3% an overflow no group shows (every group blamed),
    10% of groups contaminated, some groups without gradients."""
    gen = torch.Generator().manual_seed(G + (rule == "max_ema") + 2 * cap)
    state = (torch.full((G,), 2.0**15), torch.zeros(G, **I32), torch.zeros(G), torch.zeros(G, **I32),
             torch.ones(G, **I32), torch.zeros(G), torch.zeros(G))
    steps = []
    for _ in range(150):
        absmax = torch.exp2(torch.empty(G).uniform_(-30, 30, generator=gen))
        r = torch.rand(4, generator=gen)
        if r[0] < 0.15:
            absmax[int(torch.randint(G, (), generator=gen))] = float("inf") if r[1] < 0.7 else float("nan")
        group_found = (~torch.isfinite(absmax)).float()
        emitted = torch.zeros(G)
        if r[2] < 0.05:
            emitted[int(torch.randint(G, (), generator=gen))] = 1.0
        contaminated = (torch.rand(G, generator=gen) < 0.1).float()
        found = torch.maximum(group_found.amax(), emitted.amax()).reshape(())
        if r[3] < 0.03:
            found = torch.tensor(1.0)
        numel = torch.randint(0, 3, (G,), generator=gen) * 1000
        steps.append((found, group_found, absmax, numel, emitted, contaminated))
    hyper = (rule, 32768.0, 0.9, 2.0, 0.5, 2, True, 2.0**-4, 2.0**20, cap)
    return state, steps, hyper


def adaloss_case(G: int) -> tuple:
    return (1e-3, 16.0, 2.0**40, 0.5, 2.0**-30, None, G)


LAYERWISE = [(G, rule, cap) for G in GROUPS for rule in ("max_ema", "backoff_growth") for cap in (False, True)
             if not (rule == "backoff_growth" and cap)]


@pytest.mark.parametrize("G,rule,cap", LAYERWISE)
def test_layerwise_op_equals_twin_at_many_groups(ops, G, rule, cap):
    state, steps, hyper = layerwise_trajectory(G, rule, cap)
    twin = tuple(t.clone() for t in state)
    blamed_some = differed = 0
    for i, stats in enumerate(steps):
        ops.layerwise_update_(*state, *stats, *hyper)
        layerwise_update_(*twin, *stats, *hyper)
        assert_states_equal(i, state, twin)
        blamed_some += int(stats[0].item() > 0 and 0 < state[6].sum().item() < G)
        differed += int(state[0].unique().numel() > 1)
    assert blamed_some > 3, "no attributed overflow: attribution untested"
    assert differed > 10, "the groups' scales hardly differed"


@pytest.mark.parametrize("G", GROUPS)
def test_adaloss_op_equals_twin_at_many_groups(ops, G):
    state, steps, hyper, check = adaloss_trajectory(adaloss_case(G))
    twin = tuple(t.clone() for t in state)
    for i, args in enumerate(steps):
        load_stats(ops.adaloss_step_)(*state, *args, *hyper)
        load_stats(adaloss_step_)(*twin, *args, *hyper)
        assert_states_equal(i, state, twin)
    check(state)


@pytest.mark.parametrize("G,rule,cap", LAYERWISE)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layerwise_kernel_equals_cpu_op_at_many_groups(ops, G, rule, cap):
    state, steps, hyper = layerwise_trajectory(G, rule, cap)
    dev = tuple(t.cuda() for t in state)
    for i, stats in enumerate(steps):
        ops.layerwise_update_(*state, *stats, *hyper)
        stats_dev = tuple(t.cuda() for t in stats)
        with no_sync():
            ops.layerwise_update_(*dev, *stats_dev, *hyper)
        assert_states_equal(i, tuple(d.cpu() for d in dev), state)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adaloss_kernel_equals_cpu_op_at_many_groups(ops, G):
    state, steps, hyper, check = adaloss_trajectory(adaloss_case(G))
    dev = tuple(t.cuda() for t in state)
    for i, args in enumerate(steps):
        load_stats(ops.adaloss_step_)(*state, *args, *hyper)
        args_dev = tuple(a.cuda() for a in args)
        with no_sync():
            load_stats(ops.adaloss_step_)(*dev, *args_dev, *hyper)
        assert_states_equal(i, tuple(d.cpu() for d in dev), state)
    check(state)
