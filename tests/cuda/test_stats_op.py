"""The fused statistics pass (CPU twin) against the plain-torch reference of strategies/stats.py.

Exact: found_inf, abs-max, zero/subnormal/numel counts and every unscaled gradient bit. Sums of
squares: rtol 1e-6 against the float64 truth; against the reference rtol 1e-4 from 600K elements
(1e-5 below), because the reference squares torch's float32-accumulated per-tensor norms and is
itself only that accurate (measured: 1.9e-6 at 110K elements, 2e-5 at 50M).
"""

from __future__ import annotations

import pytest
import torch

from strategies.stats import GradStats, unscale_and_stats_reference
from tests.cuda.gradients import assert_bits_equal, is_dense, make_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 16, 17, 255, 1000, 4099, 40_000, 600_001]  # 600_001 spans three 256K chunks (kChunk)
SPECIAL_SETS = [(), ("zero", "-zero", "fp16_min_normal", "below_min_normal", "fp16_min_sub", "fp32_sub"),
                ("inf",), ("-inf", "nan"), ("nan",), ("big", "huge")]


def run_op(ops, grads, inv, group_index=None, num_groups=1) -> GradStats:
    gi = [] if group_index is None else list(group_index)
    return GradStats(*ops.unscale_and_stats(grads, inv, gi, num_groups))


def sumsq_truth(grads, group_index, num_groups) -> torch.Tensor:
    out = torch.zeros(num_groups, dtype=torch.float64)
    for k, g in enumerate(grads):
        out[0 if group_index is None else group_index[k]] += g.double().square().sum()
    return out


def check(ops, grads_a, grads_b, inv, group_index=None, num_groups=1, ref_rtol=1e-5) -> GradStats:
    got = run_op(ops, grads_a, inv, group_index, num_groups)
    want = unscale_and_stats_reference(grads_b, inv, group_index, num_groups)
    for a, b in zip(grads_a, grads_b):
        assert_bits_equal(a, b)
    assert torch.equal(got.found_inf, want.found_inf)
    torch.testing.assert_close(got.absmax, want.absmax, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.zeros, want.zeros)
    assert torch.equal(got.subnormals, want.subnormals)
    assert torch.equal(got.numel, want.numel)
    truth = sumsq_truth(grads_b, group_index, num_groups)
    torch.testing.assert_close(got.sumsq.double(), truth.float().double(), rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(got.sumsq, want.sumsq, rtol=ref_rtol, atol=0, equal_nan=True)
    for f in ("found_inf", "absmax", "sumsq"):
        assert getattr(got, f).dtype == torch.float32 and getattr(got, f).shape == (num_groups,)
    for f in ("zeros", "subnormals", "numel"):
        assert getattr(got, f).dtype == torch.int64
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", SPECIAL_SETS, ids=lambda s: "+".join(s) or "plain")
def test_matches_reference_one_group(ops, dtype, specials):
    inv = torch.tensor(2.0**-7 * 1.375)  # not a power of two: rounding of x * inv matters
    a = make_grads(SIZES, dtype, seed=1, specials=specials)
    b = make_grads(SIZES, dtype, seed=1, specials=specials)
    got = check(ops, a, b, inv, ref_rtol=1e-4)
    if "nan" in specials:
        assert got.found_inf.item() == 1.0 and torch.isnan(got.absmax).all()
    if specials == ("inf",):
        assert got.found_inf.item() == 1.0 and got.absmax.item() == float("inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inv_value", [1.0, 2.0**-16, 3.0, 1e-30, 1e30, 0.0, float("inf"), -0.5])
def test_inverse_scales(ops, dtype, inv_value):
    """inv == 1 leaves values untouched; tiny/huge inv under/overflow exactly like torch's op;
    zero, infinite and negative inv take the per-element path and still match."""
    inv = torch.tensor(inv_value)
    specials = ("zero", "fp16_min_sub", "big")
    a = make_grads([1, 33, 5000], dtype, seed=2, specials=specials)
    b = make_grads([1, 33, 5000], dtype, seed=2, specials=specials)
    check(ops, a, b, inv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(ops, dtype):
    sizes = [6, 30, 3000, 65_538, 9, 1]
    layouts = ("column_major", "strided", "contiguous")
    a = make_grads(sizes, dtype, seed=3, specials=("zero", "fp16_min_sub"), layouts=layouts)
    b = make_grads(sizes, dtype, seed=3, specials=("zero", "fp16_min_sub"), layouts=layouts)
    assert not a[0].is_contiguous() and not a[1].is_contiguous()
    strides = [g.stride() for g in a]
    check(ops, a, b, torch.tensor(0.3))
    assert [g.stride() for g in a] == strides  # unscaled in place, views intact


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_major_offset_and_sliced_views(ops, dtype):
    """Really column-major gradients (torch.empty(3, n).t()), views starting one element into
    their buffer and transposed slices, at sizes that are not multiples of 3 or of a vector."""
    sizes = [7, 65_537, 1, 4099, 0, 13]
    layouts = ("transposed", "offset", "transposed_slice")
    a = make_grads(sizes, dtype, seed=6, specials=("zero", "fp16_min_sub", "big"), layouts=layouts)
    b = make_grads(sizes, dtype, seed=6, specials=("zero", "fp16_min_sub", "big"), layouts=layouts)
    assert a[0].shape == (7, 3) and a[0].stride() == (1, 7) and is_dense(a[0])
    assert a[1].storage_offset() == 1 and a[2].shape == (1, 3) and not is_dense(a[5])
    strides = [g.stride() for g in a]
    check(ops, a, b, torch.tensor(0.3))
    assert [g.stride() for g in a] == strides


def test_several_groups_and_mixed_dtypes(ops):
    sizes = [100, 0, 5000, 33, 40_000, 7, 1, 2048]
    groups = [0, 1, 2, 2, 3, 0, 3, 1]
    inv = torch.tensor([2.0**-3, 1.0, 0.7, 2.0**10])  # group 1 untouched (inv == 1)

    def grads(seed):
        gen_dtypes = [torch.float32, torch.float16, torch.bfloat16]
        out = []
        for k, n in enumerate(sizes):
            sp = ("inf",) if k == 3 else ("zero", "fp16_min_sub")  # overflow only in group 2
            out += make_grads([n], gen_dtypes[k % 3], seed=seed + k, specials=sp)
        return out

    got = check(ops, grads(10), grads(10), inv, groups, 4)
    assert got.found_inf.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_empty_list_and_empty_groups(ops):
    got = run_op(ops, [], torch.tensor(0.5), None, 3)
    want = unscale_and_stats_reference([], torch.tensor(0.5), None, 3)
    for f in ("found_inf", "absmax", "sumsq", "zeros", "subnormals", "numel"):
        assert torch.equal(getattr(got, f), getattr(want, f))


def test_large_gradient_sumsq_accuracy(ops):
    """On 2M elements the fused pass keeps rtol 1e-6 to the float64 truth, and agrees with the
    reference to the reference's own accuracy (float accumulation inside torch's norm)."""
    a = make_grads([1_000_003, 1_000_000], torch.float32, seed=4, specials=("zero",))
    b = make_grads([1_000_003, 1_000_000], torch.float32, seed=4, specials=("zero",))
    check(ops, a, b, torch.tensor(2.0**-12), ref_rtol=1e-4)


def test_independent_of_thread_count(ops):
    """Chunk partials are reduced in a fixed order: same bits with 1 thread or many."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            g = make_grads([300_000, 12345], torch.float32, seed=5)
            results.append(run_op(ops, g, torch.tensor(0.37)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0].sumsq, results[1].sumsq)


def test_errors(ops):
    g = [torch.ones(3)]
    with pytest.raises(RuntimeError, match="group_index entries must be in"):
        ops.unscale_and_stats(g, torch.tensor(1.0), [2], 2)
    with pytest.raises(RuntimeError, match="one entry per gradient"):
        ops.unscale_and_stats(g, torch.tensor(1.0), [0, 0], 1)
    with pytest.raises(RuntimeError, match="inv_scale must have 1 or 2 elements"):
        ops.unscale_and_stats(g, torch.ones(3), [0], 2)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ops.unscale_and_stats([torch.ones(3, dtype=torch.float64)], torch.tensor(1.0), [], 1)


@pytest.mark.parametrize("groups,more", [(1, False), (1, True), (5, False), (5, True)])
def test_count_fraction_equals_the_reference_bit_for_bit(ops, groups, more):
    """The fraction op (one op where GradStats.fraction took six) equals the plain-torch oracle
    on random counts, including counts that are not exact in float32 and empty groups."""
    from strategies.stats import count_fraction, count_fraction_reference

    gen = torch.Generator().manual_seed(groups * 2 + more)
    for _ in range(200):
        numel = torch.randint(0, 2**40, (groups,), generator=gen)
        numel[torch.rand(groups, generator=gen) < 0.2] = 0
        counts = (numel.double() * torch.rand(groups, generator=gen, dtype=torch.float64) / 2).long()
        extra = (numel - counts) // 3 if more else None
        got = ops.count_fraction(numel, counts, extra)
        want = count_fraction_reference(numel, counts, extra)
        assert got.dtype == torch.float32 and got.shape == ()
        assert got.view(torch.int32) == want.view(torch.int32), (numel, counts, extra)
        assert count_fraction(numel, counts, extra).view(torch.int32) == want.view(torch.int32)
    zero = torch.zeros(groups, dtype=torch.int64)
    assert ops.count_fraction(zero, zero, zero if more else None).item() == 0.0  # no entries: 0, not NaN
