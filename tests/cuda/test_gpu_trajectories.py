"""The CUDA kernels of amax_history (one block), hybrid, learned, underflow_target, tolerance
(one thread each) and AdaLoss (one block) against the CPU op and the Python twin, over the trajectories of
test_update_trajectories.py, without a host sync; the sync-free exponent histogram of
underflow_target's hook on CUDA; and every rule's epilogue ops (record_step_, count_fraction).
Skipped without a GPU.

learned and hybrid's probe take log2 / exp2 / pow in double on both devices (CUDA's within 1-2
ulp of double, the C library's on the host) and round once to float32: equal bit for bit unless
two such results straddle a float32 rounding boundary (about 2^-29 per evaluation)."""

from __future__ import annotations

import pytest
import torch

from strategies.rules.underflow_target import exponent_histogram
from tests.cuda.gpu import no_sync
from tests.cuda.trajectories import TRAJECTORIES, assert_states_equal, with_loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FIRST_CASES = [(op, cases[k]) for op, (_, _, cases) in TRAJECTORIES.items() for k in (0, -1)]


def cuda_copy(args: tuple) -> tuple:
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("op_name,case", FIRST_CASES, ids=[f"{op}-{i % 2}" for i, (op, _) in enumerate(FIRST_CASES)])
def test_update_kernel_equals_cpu_op_and_twin(cuda_ops, op_name, case):
    twin, build, _ = TRAJECTORIES[op_name]
    cpu, steps, hyper, check = build(case)
    ref = tuple(t.clone() for t in cpu)
    dev = cuda_copy(cpu)
    op = with_loader(op_name, getattr(cuda_ops, op_name))
    for i, args in enumerate(steps):
        op(*cpu, *args, *hyper)
        with_loader(op_name, twin)(*ref, *args, *hyper)
        args_dev = cuda_copy(args)
        with no_sync():
            op(*dev, *args_dev, *hyper)
        assert_states_equal(i, cpu, ref)
        assert_states_equal(i, tuple(d.cpu() for d in dev), cpu)
    check(cpu)


def test_exponent_histogram_on_cuda_is_sync_free_and_equals_the_cpu(cuda_ops):
    gen = torch.Generator().manual_seed(6)
    g = torch.exp2(torch.empty(100_000).uniform_(-160, 130, generator=gen)) * torch.randn(100_000, generator=gen)
    g[torch.rand(100_000, generator=gen) < 0.1] = 0.0
    g[:7] = float("nan")
    gd = g.cuda()
    with no_sync():
        got = exponent_histogram(gd)
    assert torch.equal(got.cpu(), exponent_histogram(g))


@pytest.mark.parametrize("op_name,case", [(op, k) for op in ("record_step_", "count_fraction") for k in range(3)])
def test_epilogue_ops_on_cuda_equal_the_cpu_and_never_sync(cuda_ops, op_name, case):
    """record_step_ (every rule's update ends with it) and count_fraction on the GPU: the CPU op's
    results bit for bit, without a host sync."""
    from tests.cuda.samples import SAMPLES

    cpu = SAMPLES[op_name][case]()
    dev = cuda_copy(cpu)
    want = getattr(cuda_ops, op_name)(*cpu)
    with no_sync():
        got = getattr(cuda_ops, op_name)(*dev)
    if want is None:
        assert_states_equal(0, tuple(a.cpu() for a in dev if isinstance(a, torch.Tensor)),
                            tuple(a for a in cpu if isinstance(a, torch.Tensor)))
    else:
        assert got.device.type == "cuda" and got.cpu().view(torch.int32) == want.view(torch.int32)
