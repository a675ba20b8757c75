"""The layer-boundary ops (``cuda/cpu/boundary_cpu.cpp``, ``cuda/kernels/boundary_kernel.cu``)
against their plain-torch references: ``boundary_rescale`` = ``group_links.times`` + ``stats.extremes``,
``grad_extremes`` = ``stats.extremes_reference``, ``exponent_histogram`` =
``stats.exponent_histogram_reference``; bit for bit, every dtype, the values that matter (NaN,
Inf, zeros, fp16 and fp32 subnormals, the largest floats), the vector body and its scalar tail,
non-contiguous gradients. The CUDA kernels are compared with the CPU twin on a GPU (marked ``gpu``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from strategies import kernels
from strategies.group_links import times
from strategies.stats import exponent_histogram_reference, extremes_reference
from tests.cuda.gpu import no_sync
from tests.cuda.gradients import assert_bits_equal, make_grad

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 15, 16, 17, 1000, 65_537]
SPECIALS = [(), ("nan", "zero"), ("inf", "-inf", "fp16_min_sub"), ("fp32_sub", "-zero", "huge"), ("-inf",)]
RATIOS = torch.tensor([[1.0, 2.0**-9, 0.5], [2.0**9, 1.0, 2.0**-24], [2.0, 2.0**24, 1.0]])


def _grad(n: int, dtype: torch.dtype, specials: tuple[str, ...], layout: str = "contiguous",
          seed: int = 0) -> torch.Tensor:
    return make_grad(n, dtype, torch.Generator().manual_seed(seed + n), specials, layout)


def _same_extremes(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal [min, max] (NaN where the reference has NaN; -0.0 and 0.0 alike, as min/max may
    return either zero: every use reads |x| or max - min)."""
    assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape == (2,)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", SPECIALS, ids=lambda s: "+".join(s) or "plain")
@pytest.mark.parametrize("n", SIZES)
def test_boundary_rescale_is_times_and_extremes(ops, dtype, specials, n):
    g = _grad(n, dtype, specials)
    for index in range(RATIOS.numel()):
        out, ext = ops.boundary_rescale(g, RATIOS, index)
        assert_bits_equal(out, times(g, RATIOS.view(-1)[index]))
        _same_extremes(ext, extremes_reference(g))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", SPECIALS, ids=lambda s: "+".join(s) or "plain")
@pytest.mark.parametrize("n", SIZES)
def test_extremes_and_histogram_match_the_references(ops, dtype, specials, n):
    g = _grad(n, dtype, specials)
    _same_extremes(ops.grad_extremes(g), extremes_reference(g))
    assert torch.equal(ops.exponent_histogram(g), exponent_histogram_reference(g))


def test_histogram_bins_every_float32_exponent(ops):
    """Every power of two float32 holds (subnormals 2^-149 .. 2^-127 included), its neighbours
    above (the same bin) and below, and the largest float: one count each, where frexp puts it."""
    e = torch.arange(-149, 128, dtype=torch.float64)
    g = torch.cat([torch.exp2(e), torch.exp2(e) * 1.5, -torch.exp2(e[1:]) * (1 - 2.0**-23),
                   torch.tensor([3.4028234663852886e38])]).float()
    h = ops.exponent_histogram(g)
    assert torch.equal(h, exponent_histogram_reference(g)) and int(h.sum()) == g.numel()
    _, exp = torch.frexp(g.double())
    assert torch.equal(h, torch.bincount((exp - 1 + 150).long(), minlength=280)[:280])


@pytest.mark.parametrize("layout", ["strided", "column_major", "transposed_slice"])
def test_non_contiguous_gradients(ops, layout):
    g = _grad(999, torch.float32, ("nan",), layout)
    out, ext = ops.boundary_rescale(g, RATIOS, 1)
    assert_bits_equal(out, times(g, RATIOS.view(-1)[1]))
    _same_extremes(ext, extremes_reference(g))
    assert torch.equal(ops.exponent_histogram(g), exponent_histogram_reference(g))


def test_refuses_an_index_outside_the_table(ops):
    with pytest.raises(RuntimeError, match=r"index must be in \[0, 9\), got 9"):
        ops.boundary_rescale(torch.ones(4), RATIOS, 9)


def test_boundary_applies_only_where_the_op_is_exact(ops):
    """Plain float32/16/bf16 tensors that do not require grad take the op; float64, a tensor in a
    create_graph backward and a FakeTensor take the references."""
    assert kernels.boundary_applies("boundary_rescale", torch.ones(3))
    assert not kernels.boundary_applies("boundary_rescale", torch.ones(3, dtype=torch.float64))
    assert not kernels.boundary_applies("grad_extremes", torch.ones(3, requires_grad=True))
    with FakeTensorMode():
        assert not kernels.boundary_applies("exponent_histogram", torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specials", SPECIALS, ids=lambda s: "+".join(s) or "plain")
@pytest.mark.parametrize("n", [*SIZES, 3_000_001])
def test_cuda_kernels_match_the_cpu_twin_without_a_sync(cuda_ops, dtype, specials, n):
    g = _grad(n, dtype, specials)
    gc, ratios = g.cuda(), RATIOS.cuda()
    with no_sync():
        out, ext = cuda_ops.boundary_rescale(gc, ratios, 7)
        ext_only = cuda_ops.grad_extremes(gc)
        hist = cuda_ops.exponent_histogram(gc)
    ref_out, ref_ext = cuda_ops.boundary_rescale(g, RATIOS, 7)
    assert_bits_equal(out.cpu(), ref_out)
    _same_extremes(ext.cpu(), ref_ext)
    _same_extremes(ext_only.cpu(), ref_ext)
    assert torch.equal(hist.cpu(), exponent_histogram_reference(g))


SUBNORMAL_LO = {torch.float32: -149, torch.float16: -24, torch.bfloat16: -133}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_histogram_bins_every_exponent_of_each_dtype(ops, dtype):
    """Every power of two of ``dtype`` (its subnormals included), 1.5 times it and minus the largest
    value below it, shuffled into one block with zeros, Inf and NaN: the op counts fields and
    subnormal top bits on the bit patterns, so each exponent of each format is checked once."""
    e = torch.arange(SUBNORMAL_LO[dtype], int(math.log2(torch.finfo(dtype).max)) + 1, dtype=torch.float64)
    p = torch.exp2(e)
    g = torch.cat([p, p * 1.5, -p * (1 - torch.finfo(dtype).eps / 2)]).to(dtype)
    g = torch.cat([g, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=dtype)])
    g = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))]
    h = ops.exponent_histogram(g)
    assert torch.equal(h, exponent_histogram_reference(g))
    _, exp = torch.frexp(torch.exp2(e).to(dtype).double())
    want = torch.bincount((exp - 1 + 150).long(), minlength=280)[:280]
    assert torch.equal(ops.exponent_histogram(torch.exp2(e).to(dtype)), want)


def test_histogram_follows_blocks_of_far_apart_magnitudes(ops):
    """Segments 2^-60, 2^40, subnormal and 2^-3 in scale, of lengths that do not align with the
    op's blocks of 255 vectors: each block places its own window of fields."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, generator=gen) * s for n, s in
             ((5000, 2.0**-60), (4081, 2.0**40), (333, 2.0**-140), (9000, 2.0**-3), (17, 1.0))]
    g = torch.cat(parts)
    assert torch.equal(ops.exponent_histogram(g), exponent_histogram_reference(g))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_histogram_of_a_constant_counts_past_the_byte_counters(ops, dtype):
    """2^17 + 7 entries, 1.5 then -3.0: every vector lane of a block counts the same field in each
    of its vectors, so the most a lane's byte counter holds (255), over many blocks and a scalar tail."""
    g = torch.full((2**17 + 7,), 1.5, dtype=dtype)
    g[2**16:] = -3.0
    h = ops.exponent_histogram(g)
    assert torch.equal(h, exponent_histogram_reference(g))
    assert int(h[150]) == 2**16 and int(h[151]) == 2**16 + 7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rescale_rounds_16_bit_products_as_torch(ops, dtype):
    """Ratios that are not powers of two round the float product back to the format: every one
    of the 2^16 bit patterns (subnormals, Inf, NaN included) times each ratio, bit for bit as
    ``group_links.times`` (torch's casts: nearest even, overflow to Inf, underflow to subnormals)."""
    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    ratios = torch.tensor([0.3, 1.7, 1 / 3, 3.0e-5, 1.0e4, 0.9999999, 1.0000001, 65504.0], dtype=torch.float32)
    for index in range(ratios.numel()):
        out, ext = ops.boundary_rescale(g, ratios, index)
        assert_bits_equal(out, times(g, ratios[index]))
        _same_extremes(ext, extremes_reference(g))
