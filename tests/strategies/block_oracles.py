"""TransformerEngine's FP8-blockwise and NVFP4 cast rules restated in plain Python: one float at a
time, fp32 rounding by ``struct`` (a Python float is a double; an fp32 ``+ * /`` computed in
double and rounded once to fp32 is the correctly rounded fp32 result, since 53 >= 2 * 24 + 2),
loops over blocks. Oracles for ``tests/strategies/test_blocks_te.py``; nothing here imports the
code under test.

Sources restated (NVIDIA/TransformerEngine):

* ``common/recipe/recipe_common.cuh`` ``compute_scale_from_amax`` (FP8 blockwise scale) and
  ``tests/pytorch/references/blockwise_quantizer_reference.py`` (``q = fp8(clamp(x * s))``,
  ``scale_inv = 1 / s``, dequantised ``q * scale_inv``, zero padding of partial tiles);
* ``common/cast/nvfp4/core_nvfp4.cuh`` (``compute_global_encode_scaling_factor_FP4``,
  ``compute_decoding_scaling_factor``), ``quantize_transpose_nvfp4.cuh`` (``block_scale_inverse``),
  ``dequantize_nvfp4.cuh`` (``final_scale = scale * amax * (1 / (6 * 448))``) and
  ``pytorch/custom_recipes/reference_nvfp4.py`` (``cast_to_fp4x2``: round to nearest, ties to even).
"""

from __future__ import annotations

import math
import struct

FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
E4M3 = (448.0, 3, -6)
E5M2 = (57344.0, 2, -14)
E2M1 = (6.0, 1, 0)
"""(max, mantissa bits, smallest normal exponent) of each element format."""


def f32(v: float) -> float:
    """``v`` rounded to the nearest fp32 (ties to even; +-inf past the largest finite one)."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def div(a: float, b: float) -> float:
    """IEEE fp32 ``a / b`` (x / 0 is +-inf, 0 / 0 and NaN operands NaN)."""
    if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0) or (math.isinf(a) and math.isinf(b)):
        return math.nan
    if b == 0:
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def mul(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or ((a == 0 or b == 0) and (math.isinf(a) or math.isinf(b))):
        return math.nan
    return f32(a * b)


def fmin(a: float, b: float) -> float:
    """``min`` that propagates NaN (``torch.minimum``)."""
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def round_elem(v: float, fmt: tuple[float, int, int], u: float | None = None) -> float:
    """``v`` saturated to +-max and rounded onto the grid of ``fmt``: nearest, ties to even, or,
    given a uniform draw ``u``, stochastically (``t = v / ulp`` goes up from ``floor(t)`` when
    ``u < t - floor(t)``). The sign of ``v`` is kept on a zero result; NaN stays NaN."""
    vmax, mbits, emin = fmt
    if math.isnan(v):
        return v
    v = max(-vmax, min(vmax, v))
    if v == 0.0:
        return v
    _, e = math.frexp(abs(v))
    ulp = 2.0 ** (max(e - 1, emin) - mbits)
    t = v / ulp
    if u is None:
        n = round(t)  # Python rounds exact halves to even
    else:
        lo = math.floor(t)
        n = lo + 1 if u < t - lo else lo
    return math.copysign(n * ulp, v)


def amax_of(vals: list[float]) -> float:
    """abs-max that propagates NaN (``torch.amax``)."""
    return math.nan if any(math.isnan(x) for x in vals) else max(abs(x) for x in vals)


def tiles(rows: int, cols: int, bm: int, bn: int) -> list[list[tuple[int, int]]]:
    """The index lists of ``bm x bn`` tiles of a ``rows x cols`` matrix (partial tiles at the
    edges hold only the real indices: the zero padding changes no abs-max)."""
    out = []
    for r0 in range(0, rows, bm):
        for c0 in range(0, cols, bn):
            out.append([(r, c) for r in range(r0, min(r0 + bm, rows)) for c in range(c0, min(c0 + bn, cols))])
    return out


def te_blockwise_scale(amax: float, fmax: float, pow2: bool, eps: float, value_for_inf: float) -> float:
    """``compute_scale_from_amax`` of ``recipe_common.cuh``, line for line."""
    if amax < eps:
        amax = eps
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = div(fmax, amax)
    if math.isinf(scale):
        scale = value_for_inf
    if pow2:
        scale = from_bits(f32_bits(scale) & 0xFF800000)
    return scale


def te_blockwise(x: list[list[float]], fmt: tuple[float, int, int], bm: int, bn: int, pow2: bool,
                 eps: float, value_for_inf: float) -> tuple[list[list[float]], list[float], list[list[float]]]:
    """FP8 blockwise cast of a matrix with ``bm x bn`` blocks: (values, scale_inv per tile in
    row-major tile order, dequantised)."""
    rows, cols = len(x), len(x[0])
    q = [[0.0] * cols for _ in range(rows)]
    dq = [[0.0] * cols for _ in range(rows)]
    scale_inv = []
    for tile in tiles(rows, cols, bm, bn):
        s = te_blockwise_scale(amax_of([x[r][c] for r, c in tile]), fmt[0], pow2, eps, value_for_inf)
        inv = div(1.0, s)
        scale_inv.append(inv)
        for r, c in tile:
            q[r][c] = round_elem(mul(x[r][c], s), fmt)
            dq[r][c] = mul(q[r][c], inv)
    return q, scale_inv, dq


def te_nvfp4(x: list[list[float]], bm: int, u: list[list[float]] | None = None) -> dict:
    """NVFP4 cast of a matrix with ``bm x 16`` blocks (bm = 1 or 16): values, E4M3 block scales
    (tile order), tensor decode scale and dequantised values. ``u``: uniforms for stochastic
    rounding, one per element."""
    rows, cols = len(x), len(x[0])
    big = amax_of([v for row in x for v in row])
    s_enc = fmin(div(448.0 * 6.0, big), FLT_MAX)
    if big == 0.0 or s_enc == 0.0:
        s_enc = 1.0
    s_dec = div(1.0, s_enc)
    rcp6, rcp2688 = f32(1.0 / 6.0), f32(1.0 / 2688.0)
    q = [[0.0] * cols for _ in range(rows)]
    dq = [[0.0] * cols for _ in range(rows)]
    scales = []
    for tile in tiles(rows, cols, bm, 16):
        amax = amax_of([x[r][c] for r, c in tile])
        s_b = round_elem(fmin(mul(amax, mul(s_enc, rcp6)), FLT_MAX), E4M3)
        enc = fmin(div(1.0, mul(s_b, s_dec)), FLT_MAX)
        final = mul(mul(s_b, big), rcp2688)
        scales.append(s_b)
        for r, c in tile:
            q[r][c] = round_elem(mul(x[r][c], enc), E2M1, None if u is None else u[r][c])
            dq[r][c] = mul(q[r][c], final)
    return {"values": q, "scales": scales, "tensor_scale": mul(big, rcp2688), "dequantized": dq}
