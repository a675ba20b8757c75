"""The arithmetic under :mod:`strategies.blocks`: rounding onto a narrow float grid, the E8M0
exponent of each MX scale rounding mode, and the 16-point random Hadamard transform.

All functions are elementwise or per-row torch ops on fp32 tensors, on the tensors' device, with
no host sync.

**Grid.** A format with ``mbits`` mantissa bits and smallest normal exponent ``emin`` has, at
``|v|`` in ``[2^e, 2^(e+1))``, the spacing ``ulp = 2^(max(e, emin) - mbits)`` (subnormals share
the spacing of ``emin``). ``v / ulp`` is exact (a power-of-two scaling), so rounding it to an
integer rounds ``v`` onto the grid: nearest with ties to even (``torch.round``: IEEE
roundTiesToEven, the rounding of torch's float8 casts, of torchao's FP4 packer and of TE's
``cast_to_fp4x2``), or stochastically: up with probability ``frac(v / ulp)``, so ``E[q] = v``.
Callers clamp ``v`` to ``+-max`` first (saturation); ``max`` is on the grid, so neither rounding
leaves the range.
"""

from __future__ import annotations

import torch

from strategies.block_recipes import Element

__all__ = [
    "TE_RHT_SIGNS",
    "e8m0_exponent",
    "exponent_field",
    "rht",
    "rht_inverse",
    "rht_signs",
    "round_nearest",
    "round_stochastic",
]

TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TransformerEngine's fixed RHT sign vector (``get_wgrad_sign_vector`` in
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``)."""


def _ulp(v: torch.Tensor, elem: Element) -> torch.Tensor:
    _, e = torch.frexp(v)  # v = f 2^e, 0.5 <= |f| < 1: the exponent of |v| is e - 1
    return torch.ldexp(torch.ones_like(v), torch.clamp(e - 1, min=elem.emin) - elem.mbits)


def round_nearest(v: torch.Tensor, elem: Element) -> torch.Tensor:
    """``v`` (fp32, already within ``+-elem.max``) rounded to the nearest grid point, ties to even.
    NaN stays NaN."""
    ulp = _ulp(v, elem)
    return torch.round(v / ulp) * ulp


def round_stochastic(v: torch.Tensor, elem: Element, generator: torch.Generator | None = None) -> torch.Tensor:
    """``v`` (fp32, within ``+-elem.max``) rounded to one of its two grid neighbours, up with
    probability equal to its distance from the lower one over the spacing, so ``E[q] = v``.

    Draws ``torch.rand(v.shape, generator=generator)`` once (fp32 uniforms on the 2^-24 lattice),
    so the result is a deterministic function of ``v`` and the generator's state. A zero result
    keeps the sign of ``v``, as :func:`round_nearest`."""
    ulp = _ulp(v, elem)
    t = v / ulp
    lo = torch.floor(t)
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    return torch.copysign(torch.where(u < t - lo, lo + 1, lo) * ulp, v)


def exponent_field(a: torch.Tensor) -> torch.Tensor:
    """The unbiased exponent field of fp32 ``a`` as int32: ``floor(log2 |a|)`` for normal ``a``,
    -127 for zero and subnormals, 128 for inf and NaN (torchao's ``extracted_pow2``)."""
    bits = a.contiguous().view(torch.int32)
    return (torch.bitwise_right_shift(bits, 23) & 0xFF) - 127


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """``ceil(log2 a)`` exactly for finite ``a > 0`` (int32), from ``frexp`` (subnormals included)."""
    m, e = torch.frexp(a)
    return torch.where(m == 0.5, e - 1, e)


def e8m0_exponent(amax: torch.Tensor, elem: Element, mode: str) -> torch.Tensor:
    """The biased E8M0 exponent (int32 in [0, 255]; 255 is NaN) of the MX scale of blocks whose
    fp32 abs-max is ``amax``, for torchao's ``ScaleCalculationMode`` ``mode`` (see
    :class:`strategies.block_recipes.MX` for the formulas).

    ``floor``, ``ceil``, ``even``: ``clamp(E - max_pow2, -127, 128) + 127`` from the exponent field
    ``E`` (``mx_tensor.to_mx``); an infinite ``amax`` gives ``128 - max_pow2``. ``rceil``:
    ``clamp(ceil(log2(amax / max)), -127, 127) + 127``, 254 for an infinite ``amax``, 0 for zero
    (``_to_mx_rceil``). torchao's eager ``rceil`` takes ``ceil(torch.log2(.))`` in fp32, which
    rounds ``log2`` of values up to ~16 ulp above a power of two down onto the integer; this
    computes the exact ceiling, as cuBLAS, TE and torchao's compiled Blackwell path do."""
    nan = torch.isnan(amax)
    if mode == "rceil":
        descale = amax / elem.max
        c = torch.where(descale > 0, _ceil_log2(descale), torch.full_like(descale, -127, dtype=torch.int32))
        biased = torch.clamp(c, -127, 127) + 127
        biased = torch.where(torch.isinf(amax), 254, biased)
        return torch.where(nan, 255, biased)
    a = amax
    if mode == "even":
        bits = a.contiguous().view(torch.int32)
        a = ((bits + (1 << (22 - elem.mbits))) & 0x7F800000).view(torch.float32)
    e = exponent_field(a)
    if mode == "ceil":
        e = e + ((a.contiguous().view(torch.int32) & 0x7FFFFF) > 0).to(torch.int32)
    biased = torch.clamp(e - elem.max_pow2, -127, 128) + 127
    return torch.where(nan, 255, biased)


def rht_signs(seed: int | None, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 RHT signs: TE's fixed vector for ``seed=None``, else ``+-1`` drawn from
    ``torch.Generator().manual_seed(seed)`` (on the CPU, then moved: the same on every device)."""
    if seed is None:
        s = torch.tensor(TE_RHT_SIGNS, dtype=torch.float32)
    else:
        g = torch.Generator().manual_seed(seed)
        s = torch.randint(0, 2, (16,), generator=g).to(torch.float32) * 2 - 1
    return s.to(device)


def _fwht16(y: torch.Tensor) -> torch.Tensor:
    """``y @ H_16`` over the last dim (size 16) by the 4-stage butterfly (fixed summation order)."""
    lead = y.shape[:-1]
    h = 1
    while h < 16:
        z = y.reshape(*lead, 16 // (2 * h), 2, h)
        a, b = z[..., 0, :], z[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*lead, 16)
        h *= 2
    return y


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x' = x H`` in tiles of 16 along the last dim, ``H = diag(signs) H_16 / 4`` (TE's
    ``x_mat @ (S H * 1/sqrt(16))``): ``x'_j = sum_i x_i s_i H_16[i, j] / 4``. Orthogonal."""
    lead, n = x.shape[:-1], x.shape[-1]
    t = x.reshape(*lead, n // 16, 16) * signs
    return (_fwht16(t) * 0.25).reshape(*lead, n)


def rht_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``y H^T = (y H_16 / 4) diag(signs)``: undoes :func:`rht` (``H H^T = I``)."""
    lead, n = y.shape[:-1], y.shape[-1]
    t = _fwht16(y.reshape(*lead, n // 16, 16)) * 0.25
    return (t * signs).reshape(*lead, n)
