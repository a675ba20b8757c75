"""strategies.blocks' MX casts against torchao's reference quantiser ``to_mx``, bit for bit: the
E8M0 scales (``get_fp_scale``), the element values (FP4 unpacked with torchao's own
``unpack_uint4`` / ``f4_unpacked_to_f32``) and the dequantised tensor (``to_dtype``), for every
``ScaleCalculationMode`` and element dtype, row-wise and column-wise, fp32 and bf16 inputs, on
random, adversarial and real gradient tensors.

torchao is an optional test dependency (the ``dev`` extra pins ``torchao==0.18.0``); without
it this module is skipped. One documented difference: torchao's eager ``RCEIL`` takes
``ceil(torch.log2(amax / max))`` in fp32, which misses the ceiling when ``amax / max`` lies a few
ulp above a power of two; strategies.blocks computes it exactly (cuBLAS, TE). Those blocks are
excluded from the comparison and pinned by :func:`test_rceil_differs_from_torchao_only_by_its_log2`.
NVFP4 follows TE, not torchao's ``nvfp4_quantize``; where the two agree and where not is pinned by
:func:`test_nvfp4_agrees_with_torchao_where_the_block_scale_is_normal`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

NO_TORCHAO = "torchao is an optional test dependency (pip install -e '.[dev]': torchao==0.18.0) and does not import"
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason=NO_TORCHAO, exc_type=ImportError)
kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels", reason=NO_TORCHAO, exc_type=ImportError)

from strategies.block_math import exponent_field  # noqa: E402
from strategies.block_recipes import ELEMENTS, MX, NVFP4  # noqa: E402
from strategies.blocks import quantize  # noqa: E402
from tests.strategies.block_cases import all_inputs, assert_same_bits  # noqa: E402

INPUTS = all_inputs()
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
MODES = ("floor", "ceil", "even", "rceil")


def torchao_cast(x: torch.Tensor, elem: str, mode: str, k: int, dim: int) -> dict[str, torch.Tensor]:
    """``to_mx`` of ``x`` along ``dim`` (0: on the contiguous transpose), the last dim
    zero-padded to a multiple of ``k`` (torchao refuses partial blocks), and its unpacking."""
    t = x if dim == -1 else x.t().contiguous()
    n = t.shape[-1]
    t = F.pad(t, (0, -n % k)).contiguous()
    dt = DTYPES[elem]
    scale, data = mx.to_mx(t, dt, k, mx.ScaleCalculationMode(mode))
    if elem == "e2m1":
        values = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data.view(torch.uint8)))
    else:
        values = data.float()
    out = {"values": values[..., :n], "scales": mx.get_fp_scale(scale),
           "dequantized": mx.to_dtype(data, scale, dt, k, x.dtype)[..., :n]}
    return out if dim == -1 else {name: v.t() for name, v in out.items()}


def log2_artefact(amax: torch.Tensor, elem: str) -> torch.Tensor:
    """Blocks where torchao's fp32 ``ceil(log2(amax / max))`` differs from the exact ceiling."""
    d = amax / ELEMENTS[elem].max
    m, e = torch.frexp(d)
    exact = torch.where(m == 0.5, e - 1, e).float()
    ok = torch.isfinite(d) & (d > 2.0**-127)
    return ok & (torch.ceil(torch.log2(d)) != exact)


@pytest.mark.parametrize("case", sorted(INPUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elem", sorted(DTYPES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_mx_matches_torchao_to_mx(case, dtype, elem, mode, dim) -> None:
    x = INPUTS[case].to(dtype)
    q = quantize(x, MX(elem=elem, scale_rounding=mode), dim=dim)
    ref = torchao_cast(x, elem, mode, 32, dim)
    if mode == "rceil":  # the one known difference (see the module docstring) does not occur here
        assert not bool(log2_artefact(q.amax, elem).any())
    assert_same_bits(q.scales, ref["scales"], "scales")
    nan = q.values.isnan() & (elem == "e2m1")  # torchao's FP4 packer has no NaN code
    values = torch.where(nan, ref["values"], q.values)
    assert_same_bits(values, ref["values"], "values")
    assert_same_bits(q.dequantized, ref["dequantized"], "dequantized")


@pytest.mark.parametrize("k", [16, 64, 128])
@pytest.mark.parametrize("mode", MODES)
def test_mx_other_block_sizes_match_torchao(k, mode) -> None:
    x = INPUTS["fc2.weight.grad"]
    for elem in DTYPES:
        q = quantize(x, MX(elem=elem, block_size=k, scale_rounding=mode))
        ref = torchao_cast(x, elem, mode, k, -1)
        assert_same_bits(q.scales, ref["scales"], f"{elem} scales")
        assert_same_bits(q.dequantized, ref["dequantized"], f"{elem} dequantized")


@pytest.mark.parametrize("elem", sorted(DTYPES))
def test_rceil_differs_from_torchao_only_by_its_log2(elem) -> None:
    """Blocks whose ``amax / max`` is 1..15 ulp above ``2^j``: the exact ceiling is ``j + 1``
    (the block max fits); torchao's fp32 ``log2`` rounds onto ``j``, so its scale is half and the
    block max is saturated. Everywhere else the two agree bit for bit."""
    fmax = ELEMENTS[elem].max
    j = torch.arange(-120, 100, dtype=torch.float32)
    amax = fmax * torch.ldexp(torch.full_like(j, 1 + 8 * 2.0**-23), j.int())
    x = torch.zeros(len(j), 32)
    x[:, 0] = amax
    x[:, 1:] = torch.randn(len(j), 31) * amax[:, None] / 8
    q = quantize(x, MX(elem=elem, scale_rounding="rceil"))
    ref = torchao_cast(x, elem, "rceil", 32, -1)
    bad = log2_artefact(q.amax, elem)[:, 0]
    assert int(bad.sum()) > len(j) // 2
    assert bool((ref["scales"][bad, 0] * 2 == q.scales[bad, 0]).all())
    assert bool((q.scaled_amax[bad, 0] <= fmax).all())
    assert bool((ref["values"][bad, 0] == fmax).all())
    same = ~bad
    assert_same_bits(q.dequantized[same], ref["dequantized"][same], "dequantized elsewhere")
    assert bool((exponent_field(q.scales[:, 0]) == exponent_field(amax / fmax) + 1).all())


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_nvfp4_agrees_with_torchao_where_the_block_scale_is_normal(case) -> None:
    """torchao's ``nvfp4_quantize`` (per-tensor scale ``amax / (448 * 6)``) gives TE's block
    scales and values wherever TE's E4M3 block scale is normal (>= 2^-6); below, torchao clamps
    the block scale to 2^-6 (``E4M3_EPS``, the smallest *normal* E4M3) where TE keeps E4M3
    subnormals and zero. TE's rule is the one strategies.blocks follows (test_blocks_te.py).
    The encode multipliers differ too (torchao ``(1 / (A / 2688)) / s_b``, TE ``1 / (s_b * (1 /
    (2688 / A)))``) by an fp32 ulp at times, which flips the rounding of exact ties: the
    power-of-two input ``exact_maxima`` has them (checked there: scales only)."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason=NO_TORCHAO, exc_type=ImportError)
    x = INPUTS[case]
    if x.shape[-1] % 16 or not bool(torch.isfinite(x).all()) or not bool(x.any()):
        pytest.skip("torchao needs whole blocks and a finite, nonzero amax")
    q = quantize(x, NVFP4())
    scale, data = nv.nvfp4_quantize(x.contiguous(), 16, nv.per_tensor_amax_to_scale(x.abs().amax()))
    values = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data.view(torch.uint8))).reshape(q.values.shape)
    normal = q.scales >= 2.0**-6
    assert_same_bits(q.scales[normal], scale.float()[normal], "block scales")
    each = normal.repeat_interleave(16, -1) & (case != "exact_maxima")
    assert_same_bits(q.values[each], values[each], "values")
    assert bool((scale.float()[~normal] == 2.0**-6).all())
