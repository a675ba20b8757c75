"""CUDA kernels against the references, on a GPU; skipped without one.

The statistics pass is compared with the plain-torch reference run on the same GPU (torch's own
CUDA unscale kernel; for bfloat16, which that kernel lacks, the manual path of strategies/stats.py,
itself checked here against torch's CPU op), the update kernels with the CPU twin (same rule
header) and the strategies' torch functions; and none of the ops may synchronise with the host
(``torch.cuda.set_sync_debug_mode("error")`` turns any sync into an error). The cases reach the
pass's re-launch path (more chunks of one dtype than one launch carries), really column-major,
misaligned and sliced gradients, and all three dtypes in one call.
"""

from __future__ import annotations

import pytest
import torch

from strategies import kernels
from strategies.rules.layerwise import layerwise_update_
from strategies.rules.max_ema import max_ema_update_
from strategies.stats import GradStats, unscale_and_check, unscale_and_stats, unscale_and_stats_reference
from tests.cuda.gpu import CHUNK, CHUNKS_PER_LAUNCH, MAX_CHUNK, check_stats, chunk_for, no_sync, to_cuda
from tests.cuda.gradients import assert_bits_equal, is_dense, make_grad, make_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", [(), ("nan", "zero"), ("inf", "fp16_min_sub", "below_min_normal")],
                         ids=lambda s: "+".join(s) or "plain")
def test_stats_kernel_matches_reference(cuda_ops, dtype, specials):
    sizes = [0, 1, 7, 1000, 65_536, 65_537, 300_001, 6]
    layouts = ("contiguous", "strided", "column_major")
    groups = [0, 1, 2, 0, 1, 2, 0, 1]
    inv = torch.tensor([2.0**-10 * 1.375, 1.0, 3.0], device="cuda")
    a = to_cuda(make_grads(sizes, dtype, seed=7, specials=specials, layouts=layouts))
    b = to_cuda(make_grads(sizes, dtype, seed=7, specials=specials, layouts=layouts))
    check_stats(cuda_ops, a, b, inv, groups, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stats_kernel_column_major_misaligned_and_sliced(cuda_ops, dtype):
    """torch.empty(3, n).t() gradients (dense, column-major: the kernel runs over the storage),
    views one element into their buffer (no 16-byte alignment: scalar head, vectors, tail), and
    transposed slices (not dense: the shim's contiguous copy and copy-back), at sizes that are
    not multiples of 3, of a vector (4 or 8) or of a chunk."""
    sizes = [7, 65_537, 1, CHUNK + 5, 4099, 0, 13, 3 * CHUNK - 1]
    layouts = ("transposed", "offset", "transposed_slice", "offset")
    specials = ("zero", "fp16_min_sub", "inf")
    a = to_cuda(make_grads(sizes, dtype, seed=8, specials=specials, layouts=layouts))
    b = to_cuda(make_grads(sizes, dtype, seed=8, specials=specials, layouts=layouts))
    assert a[0].stride() == (1, 7) and is_dense(a[0]) and not a[0].is_contiguous()
    assert a[1].storage_offset() == 1 and a[1].data_ptr() % 16 != 0
    assert not is_dense(a[2]) and not is_dense(a[6])
    check_stats(cuda_ops, a, b, torch.tensor([0.3, 1.0], device="cuda"), [k % 2 for k in range(len(sizes))], 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stats_kernel_relaunch_one_large_gradient(cuda_ops, dtype):
    """One gradient with more chunks than one launch carries (the table is launched full, then
    the rest), plus a small misaligned one after it in another group."""
    n = CHUNKS_PER_LAUNCH * CHUNK + 12_345
    assert n > 10_500_000  # above the old geometry's limit as well
    layouts = ("contiguous", "offset")
    a = to_cuda(make_grads([n, 1001], dtype, seed=9, specials=("zero", "fp16_min_sub"), layouts=layouts))
    b = to_cuda(make_grads([n, 1001], dtype, seed=9, specials=("zero", "fp16_min_sub"), layouts=layouts))
    got = check_stats(cuda_ops, a, b, torch.tensor([2.0**-10 * 1.375, 3.0], device="cuda"), [0, 1], 2)
    assert got.numel.tolist() == [n, 1001]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stats_kernel_relaunch_at_the_largest_chunk(cuda_ops, dtype):
    """Enough 16-bit elements for the longest chunk (MAX_CHUNK per block) and more of them than one
    launch carries, in one gradient after a small misaligned one; specials in both."""
    n = CHUNKS_PER_LAUNCH * MAX_CHUNK + 4099
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert chunk_for(n + 1001, sms) == MAX_CHUNK and n > CHUNKS_PER_LAUNCH * MAX_CHUNK
    specials = ("zero", "fp16_min_sub", "inf", "nan")
    a = to_cuda(make_grads([1001, n], dtype, seed=12, specials=specials, layouts=("offset", "contiguous")))
    b = to_cuda(make_grads([1001, n], dtype, seed=12, specials=specials, layouts=("offset", "contiguous")))
    got = check_stats(cuda_ops, a, b, torch.tensor([2.0**-13, 0.75], device="cuda"), [1, 0], 2)
    assert got.numel.tolist() == [n, 1001]


def test_stats_kernel_relaunch_many_small_gradients(cuda_ops):
    """More gradients of one dtype than chunks per launch (each gradient takes a chunk), in
    several groups, mixed with the other two dtypes."""
    gen = torch.Generator().manual_seed(10)
    count = CHUNKS_PER_LAUNCH + 123
    sizes = torch.randint(1, 300, (count,), generator=gen).tolist()
    groups = [k % 5 for k in range(count)]

    def grads(seed: int) -> list[torch.Tensor]:
        out = make_grads(sizes, torch.bfloat16, seed=seed, specials=("zero",), layouts=("contiguous", "offset"))
        out += make_grads([5000, 77], torch.float32, seed=seed + 1) + make_grads([333], torch.float16, seed=seed + 2)
        return to_cuda(out)

    all_groups = groups + [0, 1, 2]
    inv = torch.tensor([0.5, 1.0, 3.0, 2.0**-20, 0.7], device="cuda")
    got = check_stats(cuda_ops, grads(11), grads(11), inv, all_groups, 5)
    assert int(got.numel.sum()) == sum(sizes) + 5000 + 77 + 333


@pytest.mark.parametrize("specials", [(), ("inf",), ("nan", "big")], ids=lambda s: "+".join(s) or "plain")
def test_stats_kernel_mixed_dtypes_in_one_call(cuda_ops, specials):
    """float32, float16 and bfloat16 gradients in one call, interleaved over groups and layouts."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    sizes = [1000, 7, 65_537, 4099, 0, 300_001, 13, 2 * CHUNK + 3, 1]
    layouts = ["contiguous", "offset", "transposed", "strided", "contiguous", "offset", "transposed_slice",
               "contiguous", "offset"]

    def grads(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return to_cuda([make_grad(n, dtypes[k % 3], gen, specials if k == 4 or k == 5 else ("zero",), layouts[k])
                        for k, n in enumerate(sizes)])

    groups = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    inv = torch.tensor([2.0**-7 * 1.375, 1.0, 0.3], device="cuda")
    got = check_stats(cuda_ops, grads(12), grads(12), inv, groups, 3)
    assert got.found_inf.tolist() == [0.0, 0.0, 1.0 if specials else 0.0]


@pytest.mark.parametrize("inv_value", [2.0**-7 * 1.375, 1.0, 3.0, 1e-30, 0.0, float("inf")])
def test_bf16_manual_unscale_matches_torch_cpu_op(inv_value):
    """The bf16 CUDA path of strategies.stats (torch has no bf16 CUDA unscale kernel) gives the
    bits of torch's CPU op, and the same found_inf."""
    specials = ("zero", "fp16_min_sub", "big", "inf")
    cpu = make_grads([1, 7, 4099, 65_537], torch.bfloat16, seed=13, specials=specials,
                     layouts=("contiguous", "offset", "transposed", "strided"))
    dev = to_cuda(cpu)
    found_cpu, found_dev = torch.zeros(1), torch.zeros(1, device="cuda")
    inv_dev = torch.tensor(inv_value, device="cuda")
    torch._amp_foreach_non_finite_check_and_unscale_(cpu, found_cpu, torch.tensor(inv_value))
    with no_sync():
        unscale_and_check(dev, inv_dev, found_dev)
    for c, d in zip(cpu, dev):
        assert_bits_equal(c, d.cpu())
    assert found_dev.item() == found_cpu.item() == 1.0


def test_stats_dispatch_is_sync_free_and_uses_the_kernel(cuda_ops):
    g = [torch.randn(10_000, device="cuda") for _ in range(4)]
    inv = torch.tensor(0.5, device="cuda")
    with no_sync():
        st = unscale_and_stats(g, inv)
    assert st.numel.item() == 40_000


def test_native_update_kernel(cuda_ops):
    gen = torch.Generator().manual_seed(0)
    flags = (torch.rand(300, generator=gen) < 0.3).float()
    for hysteresis in (1, 3):
        cpu = (torch.tensor(2.0**100), torch.tensor(0, dtype=torch.int32), torch.tensor(hysteresis, dtype=torch.int32))
        dev = tuple(t.cuda() for t in cpu)
        fl = flags.cuda()
        for i in range(300):
            cuda_ops.native_update_(*cpu, flags[i].reshape(()), 1.1, 0.9, 2, hysteresis)
            with no_sync():
                cuda_ops.native_update_(*dev, fl[i].reshape(()), 1.1, 0.9, 2, hysteresis)
        for c, d in zip(cpu, dev):
            assert torch.equal(c, d.cpu())
    ref = (torch.tensor(2.0**100, device="cuda"), torch.tensor(0, dtype=torch.int32, device="cuda"))
    dev = (ref[0].clone(), ref[1].clone(), torch.tensor(1, dtype=torch.int32, device="cuda"))
    for i in range(300):
        torch._amp_update_scale_(*ref, flags[i].cuda().reshape(()), 1.1, 0.9, 2)
        cuda_ops.native_update_(*dev, flags[i].cuda().reshape(()), 1.1, 0.9, 2, 1)
        assert torch.equal(ref[0], dev[0]) and torch.equal(ref[1], dev[1])


def test_max_ema_update_kernel(cuda_ops):
    G, gen = 6, torch.Generator().manual_seed(1)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    ref = (torch.full((G,), 2.0**15, **f32), torch.zeros(G, **f32), torch.zeros(G, **i32), torch.zeros(G, **i32),
           torch.zeros(G, **f32))
    dev = tuple(t.cuda() for t in ref)
    for _ in range(300):
        absmax = torch.exp2(torch.empty(G).uniform_(-30, 30, generator=gen))
        absmax[torch.rand(G, generator=gen) < 0.05] = float("inf")
        found = (~torch.isfinite(absmax)).float()
        args = (32768.0, 0.9, 2.0, 0.5, 2, True, True)
        max_ema_update_(*ref, found, absmax, *args)
        fd, ad = found.cuda(), absmax.cuda()
        with no_sync():
            cuda_ops.max_ema_update_(*dev, fd, ad, *args)
    for r, d in zip(ref, dev):
        assert torch.equal(r, d.cpu())


def test_norm_ratio_update_kernel(cuda_ops):
    gen = torch.Generator().manual_seed(2)
    i32 = dict(dtype=torch.int32)
    cpu = (torch.tensor(2.0**16), torch.tensor(0, **i32), torch.tensor(0.0), torch.tensor(0, **i32), torch.tensor(0.0))
    dev = tuple(t.cuda() for t in cpu)
    for i in range(300):
        ref_ss = torch.exp2(torch.empty(()).uniform_(-20, 20, generator=gen))
        mp_ss = ref_ss * torch.exp2(torch.empty(()).uniform_(-12, 12, generator=gen))
        found = torch.tensor(float(i % 17 == 0))
        args = (True if i % 3 == 0 else False, 2.0, 0.5, 5, 8.0, 0.125, 0.5)
        cuda_ops.norm_ratio_update_(*cpu, found, ref_ss, mp_ss, *args)
        inputs = (found.cuda(), ref_ss.cuda(), mp_ss.cuda())
        with no_sync():
            cuda_ops.norm_ratio_update_(*dev, *inputs, *args)
    # log2f on the device may differ from the host's in the last bit: decisions exact, values close.
    for k in (0, 1, 3):
        assert torch.equal(cpu[k], dev[k].cpu())
    torch.testing.assert_close(cpu[2], dev[2].cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu[4], dev[4].cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("growth", [1.5, 3.0, 2.0])
def test_max_ema_kernel_equals_twin_on_cuda(cuda_ops, growth):
    """The Python twin run on CUDA tensors (torch's CUDA kernels: S * (1 / growth) with a host
    scalar) and the kernel agree bit for bit, also for growth factors that are not powers of two."""
    G, gen = 8, torch.Generator().manual_seed(int(growth * 10))
    f32, i32 = dict(dtype=torch.float32, device="cuda"), dict(dtype=torch.int32, device="cuda")
    twin = (torch.full((G,), 2.0**15, **f32), torch.zeros(G, **f32), torch.zeros(G, **i32), torch.zeros(G, **i32),
            torch.zeros(G, **f32))
    dev = tuple(t.clone() for t in twin)
    for i in range(300):
        absmax = torch.exp2(torch.empty(G).uniform_(-30, 30, generator=gen))
        absmax[torch.rand(G, generator=gen) < 0.05] = float("inf")
        found = (~torch.isfinite(absmax)).float().cuda()
        args = (found, absmax.cuda(), 32768.0, 0.7, growth, 0.5, 2, False, True, i % 2 == 0)
        max_ema_update_(*twin, *args)
        with no_sync():
            cuda_ops.max_ema_update_(*dev, *args)
        for r, d in zip(twin, dev):
            assert torch.equal(r.view(torch.int32) if r.dtype == torch.float32 else r,
                               d.view(torch.int32) if d.dtype == torch.float32 else d), i


@pytest.mark.parametrize("rule", ["max_ema", "backoff_growth"])
@pytest.mark.parametrize("cap", [False, True])
def test_layerwise_update_kernel(cuda_ops, rule, cap):
    """layerwise's kernel (one block, a thread per group) against the CPU twin and the Python
    twin, over a trajectory with attributed overflows and groups without gradients."""
    G, gen = 6, torch.Generator().manual_seed(3)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    cpu = (torch.full((G,), 2.0**15, **f32), torch.zeros(G, **i32), torch.zeros(G, **f32), torch.zeros(G, **i32),
           torch.ones(G, **i32), torch.zeros(G, **f32), torch.zeros(G, **f32))
    twin = tuple(t.clone() for t in cpu)
    dev = tuple(t.cuda() for t in cpu)
    blamed_some = 0
    for _ in range(300):
        absmax = torch.exp2(torch.empty(G).uniform_(-30, 30, generator=gen))
        absmax[torch.rand(G, generator=gen) < 0.05] = float("inf")
        group_found = (~torch.isfinite(absmax)).float()
        emitted = (torch.rand(G, generator=gen) < 0.05).float()
        contaminated = (torch.rand(G, generator=gen) < 0.1).float()
        found = torch.maximum(group_found.amax(), emitted.amax()).reshape(())
        numel = torch.randint(0, 3, (G,), generator=gen) * 1000
        stats = (found, group_found, absmax, numel, emitted, contaminated)
        hyper = (rule, 32768.0, 0.9, 2.0, 0.5, 2, True, 2.0**-4, 2.0**20, cap)
        cuda_ops.layerwise_update_(*cpu, *stats, *hyper)
        layerwise_update_(*twin, *stats, *hyper)
        stats_dev = tuple(t.cuda() for t in stats)
        with no_sync():
            cuda_ops.layerwise_update_(*dev, *stats_dev, *hyper)
        for c, t, d in zip(cpu, twin, dev):
            assert torch.equal(c, t) and torch.equal(c, d.cpu())
        blamed_some += int(found.item() > 0 and cpu[6].sum().item() < G)
    assert blamed_some > 0, "no attributed overflow: the test would not test attribution"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_update_ops_reject_tensors_on_another_device(cuda_ops):
    """A state tensor on another GPU is refused with a one-line error, before any launch."""
    s, t, h = torch.tensor(2.0**16, device="cuda:0"), torch.tensor(0, dtype=torch.int32, device="cuda:0"), \
        torch.tensor(1, dtype=torch.int32, device="cuda:0")
    with pytest.raises(RuntimeError, match=r"found_inf is on cuda:1 but the scale is on cuda:0"):
        cuda_ops.native_update_(s, t, h, torch.tensor(0.0, device="cuda:1"), 2.0, 0.5, 3, 1)
    assert s.item() == 2.0**16
