"""The block quantiser: one function that casts a tensor with a block-scaled recipe (MX, FP8
blockwise, NVFP4; :mod:`strategies.block_recipes`) and returns the element values, the block
scales and the dequantised tensor, plus the per-block statistics of the cast.

    q = quantize(x, MX(scale_rounding="rceil"), dim=-1)
    q.values        # fp32, x's shape: the element values on the E4M3 grid, before the scale
    q.scales        # fp32, one per block: the stored (decode) scale; x ~ values * scales
    q.dequantized   # x's shape and dtype: what a simulated low-precision GEMM would see
    block_stats(q)  # dict of device tensors: clipped-block share, flushed share, scale histogram

It is plain torch on the tensor's device with no host sync (no ``.item()``, no boolean indexing),
so it can run inside a training step. Intended call from a hook (the precision modes and the
doctor attach it; a stochastic recipe takes a generator of its own so the training RNG stream is
untouched)::

    gen = torch.Generator(device).manual_seed(seed)
    def on_grad(g):                              # tensor.register_hook / a module backward hook
        q = quantize(g, NVFP4_TE_ROLES["grad"], dim=-1, generator=gen)
        telemetry[name] = block_stats(q)         # read at the logging interval only
        return q.dequantized

**Layout.** 1-D blocks run along ``dim`` (``dim=-1``: row-wise, the forward GEMM copy;
``dim=-2`` of a matrix: column-wise, the copy TE and torchao quantise separately for the backward
GEMMs). 2-D tiles cover the last two dims (the same tiles either way: ``dim`` must name one of
them). Per-block tensors (``scales``, ``amax``, ...) have x's shape with the block dim(s) replaced
by the block count(s). A size along a block dim that is not a multiple of the block is **padded
with zeros** (TE's references pad; torchao's ``to_mx`` refuses): a zero never changes a block's
abs-max, so the scales are those of the real elements, and the padding is cut off again.

**Non-finite inputs**, per recipe: MX as torchao ``to_mx`` (a NaN block gets the E8M0 NaN scale
and dequantises to NaN; an inf saturates to the format max times a scale of 2^(128 - max_pow2),
which overflows fp32, so it dequantises to inf and the rest of its block to 0); FP8 blockwise as
TE's kernel (``compute_scale_from_amax``: a non-finite block amax gets scale 1, so an inf
**saturates to +-fmt_max, a finite value** — read ``amax`` to see it; TE's Python reference
yields NaN there instead); NVFP4 as TE's reference (a NaN anywhere makes every scale NaN; an inf
sets ``S_enc = 1`` and dequantises the tensor to +-inf / NaN). Extreme finite inputs overflow
as in the references: NVFP4's decode ``(s_b * A) / 2688`` (TE's product order) is inf once
``A > FLT_MAX / 448`` (~7.6e35), and MX ceil/even/rceil round a block max near ``FLT_MAX`` up to
``2^128`` = inf.

**torchao's edge rules kept** (bit-exact with ``to_mx``): with floor/ceil/even a block whose
E8M0 exponent clamps to -127 (amax below ~2^(-127 + max_pow2)) is divided by 2^-126 but its
stored scale is 2^-127; with rceil such a block (amax / max <= 2^-127) is multiplied by 1, not
2^127 (TE ``ptx.cuh`` ``exp2f_rcp``). Both only touch blocks below ~1e-35.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from strategies.block_math import e8m0_exponent, rht, rht_inverse, rht_signs, round_nearest, round_stochastic
from strategies.block_recipes import ELEMENTS, MX, NVFP4, FP8Blockwise, Recipe

__all__ = ["SCALE_EXP_MAX", "SCALE_EXP_MIN", "BlockQuantized", "block_stats", "quantize"]

SCALE_EXP_MIN = -149
SCALE_EXP_MAX = 128
"""The scale-exponent histogram of :func:`block_stats` counts ``floor(log2 s)`` in
``[SCALE_EXP_MIN, SCALE_EXP_MAX]`` (bin ``i`` is exponent ``SCALE_EXP_MIN + i``): every finite
positive fp32 value."""

_FLT_MAX = torch.finfo(torch.float32).max
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockQuantized:
    """The result of :func:`quantize`.

    Attributes:
        values: fp32, x's shape: the element values on the element grid, before the scale (after
            the RHT where the recipe applies one).
        scales: fp32, per block: the stored decode scale (MX: the E8M0 value ``2^e``, NaN for the
            NaN code; FP8 blockwise: ``1 / s``; NVFP4: the E4M3 block scale ``s_b``).
        dequantized: x's shape and dtype: ``values * decode`` (then the inverse RHT), where decode
            is ``scales`` (MX, FP8 blockwise) or ``(s_b * A) * fl(1/2688)`` (NVFP4).
        tensor_scale: NVFP4: the fp32 tensor decode scale ``A * fl(1/2688)`` (0-dim); else None.
        amax: fp32, per block: the abs-max of the block as cast (after the RHT).
        scaled_amax: fp32, per block: ``amax`` times the encode multiplier, before saturation;
            above the element max means the block's max element was clipped.
        nonzero: int32, per block: elements that are not zero (NaN counts).
        flushed: int32, per block: nonzero elements whose dequantised fp32 value is zero.
        recipe: the recipe; dim: the block dim (non-negative; for 2-D tiles the last dim).
    """

    values: torch.Tensor
    scales: torch.Tensor
    dequantized: torch.Tensor
    tensor_scale: Optional[torch.Tensor]
    amax: torch.Tensor
    scaled_amax: torch.Tensor
    nonzero: torch.Tensor
    flushed: torch.Tensor
    recipe: Recipe
    dim: int


Scales = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
"""Per block: the encode multiplier, the stored scale, the decode multiplier; the tensor scale."""
Rule = Callable[[torch.Tensor, Recipe, torch.dtype], Scales]


def _div(num: float, t: torch.Tensor) -> torch.Tensor:
    """IEEE ``num / t`` in fp32 (``float / Tensor`` in torch is ``t.reciprocal() * num``: two
    roundings)."""
    return torch.full_like(t, num) / t


def _mx_scales(amax: torch.Tensor, recipe: MX, dtype: torch.dtype) -> Scales:
    """MX (torchao ``to_mx``): encode ``1 / max(2^e, 2^-126)`` (rceil: ``2^-e``, 1 for the
    biased exponent 0, 2^-127 for 254), decode ``2^e`` (NaN for 255)."""
    elem = recipe.element
    biased = e8m0_exponent(amax, elem, recipe.scale_rounding)
    e = (biased - 127).to(torch.float32)
    decode = torch.where(biased == 255, torch.nan, torch.exp2(e))
    if recipe.scale_rounding == "rceil":
        enc = torch.where(biased == 0, 1.0, torch.exp2(-e))
        enc = torch.where(biased == 255, torch.nan, enc)
    else:  # torchao: scale_fp32 = clamp(bits(biased << 23), min=2^-126); data / scale_fp32
        quant = torch.where(biased == 255, torch.inf, torch.clamp(torch.exp2(e), min=2.0**-126))
        enc = _div(1.0, quant)
    return enc, decode, decode, None


def _blockwise_scales(amax: torch.Tensor, recipe: FP8Blockwise, dtype: torch.dtype) -> Scales:
    """TE ``compute_scale_from_amax``: ``s = fmax / max(amax, eps)``, 1 for 0 / inf / NaN,
    ``finfo(dtype).max`` on overflow, mantissa zeroed with ``pow2_scales``; decode ``1 / s``."""
    a = torch.clamp(amax, min=recipe.amax_epsilon) if recipe.amax_epsilon > 0 else amax
    s = _div(recipe.element.max, a)
    s = torch.where(torch.isinf(s), torch.finfo(dtype).max, s)
    s = torch.where(torch.isinf(a) | torch.isnan(a) | (a == 0), 1.0, s)
    if recipe.pow2_scales:
        s = (s.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)
    decode = _div(1.0, s)
    return s, decode, decode, None


def _nvfp4_scales(amax: torch.Tensor, recipe: NVFP4, dtype: torch.dtype) -> Scales:
    """TE NVFP4 (``core_nvfp4.cuh``, ``reference_nvfp4.py``): see :class:`NVFP4`."""
    e4m3 = ELEMENTS["e4m3"]
    big = amax.amax()
    s_enc = torch.minimum(_div(2688.0, big), torch.tensor(_FLT_MAX, device=amax.device))
    s_enc = torch.where((big == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = _div(1.0, s_enc)
    mult = s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=amax.device)
    s_b = round_nearest(torch.clamp(torch.minimum(amax * mult, s_enc.new_tensor(_FLT_MAX)), -448.0, 448.0), e4m3)
    enc = torch.minimum(_div(1.0, s_b * s_dec), s_enc.new_tensor(_FLT_MAX))
    factor = torch.tensor(1.0 / 2688.0, dtype=torch.float32, device=amax.device)
    return enc, s_b, (s_b * big) * factor, big * factor


_RULES: dict[type, Rule] = {MX: _mx_scales, FP8Blockwise: _blockwise_scales, NVFP4: _nvfp4_scales}


def _check(x: torch.Tensor, recipe: Recipe, dim: int) -> tuple[int, bool]:
    """Validate the call; return the non-negative block dim and whether the blocks are 2-D."""
    if type(recipe) not in _RULES:
        raise ValueError(f"recipe must be an MX, FP8Blockwise or NVFP4, got {type(recipe).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x must have at least one dim and one element, got shape {tuple(x.shape)}")
    nd = x.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"dim must be in [{-nd}, {nd - 1}] for a {nd}-d tensor, got {dim}")
    d = dim % nd
    two_d = getattr(recipe, "block_dims", 1) == 2
    if two_d and (nd < 2 or d < nd - 2):
        raise ValueError(f"dim must be one of the last two dims of a >= 2-d tensor for 2-D blocks, "
                         f"got dim={dim} for shape {tuple(x.shape)}")
    if isinstance(recipe, NVFP4) and recipe.rht and x.shape[d] % 16:
        raise ValueError(f"x.shape[dim] must be a multiple of 16 with rht (TE refuses too), got {x.shape[d]}")
    return (nd - 1 if two_d else d), two_d


def _to_blocks(xm: torch.Tensor, k: int, two_d: bool) -> torch.Tensor:
    """``(..., n)`` -> ``(..., n/k, k)``; 2-D: ``(..., m, n)`` -> ``(..., m/k, n/k, k*k)``,
    zero-padded to multiples of ``k``."""
    n = xm.shape[-1]
    if not two_d:
        xp = F.pad(xm, (0, -n % k))
        return xp.reshape(*xm.shape[:-1], -1, k)
    m = xm.shape[-2]
    xp = F.pad(xm, (0, -n % k, 0, -m % k))
    mb, nb = xp.shape[-2] // k, xp.shape[-1] // k
    return xp.reshape(*xm.shape[:-2], mb, k, nb, k).transpose(-3, -2).reshape(*xm.shape[:-2], mb, nb, k * k)


def _from_blocks(b: torch.Tensor, shape: torch.Size, k: int, two_d: bool) -> torch.Tensor:
    """Inverse of :func:`_to_blocks`, padding cut off."""
    if not two_d:
        return b.reshape(*shape[:-1], -1)[..., : shape[-1]]
    mb, nb = b.shape[-3], b.shape[-2]
    t = b.reshape(*shape[:-2], mb, nb, k, k).transpose(-3, -2).reshape(*shape[:-2], mb * k, nb * k)
    return t[..., : shape[-2], : shape[-1]]


def quantize(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
             generator: Optional[torch.Generator] = None) -> BlockQuantized:
    """Cast ``x`` (fp32, bf16 or fp16; read as fp32) with a block-scaled ``recipe`` along ``dim``.

    Per block: ``amax`` of the block, the recipe's encode multiplier ``m`` and stored scale;
    ``values = round(clamp(x * m, +-elem_max))`` (nearest-even, or stochastic with
    ``generator``: one ``torch.rand`` draw of the blocked shape ``(..., blocks, k)``, so the result
    is deterministic given the generator's state); ``dequantized = values * decode``, cast to
    ``x.dtype``. The formulas and their sources are in :mod:`strategies.block_recipes`; the layout,
    padding and non-finite rules in this module's docstring. No host sync.
    """
    d, two_d = _check(x, recipe, dim)
    xm = x.float() if two_d else x.float().movedim(d, -1)
    signs = None
    if isinstance(recipe, NVFP4) and recipe.rht:
        signs = rht_signs(recipe.rht_seed, x.device)
        xm = rht(xm, signs)
    k, elem = recipe.block_size, recipe.element
    blocks = _to_blocks(xm, k, two_d)
    amax = blocks.abs().amax(-1)
    enc, scales, decode, tensor_scale = _RULES[type(recipe)](amax, recipe, x.dtype)
    v = torch.clamp(blocks * enc.unsqueeze(-1), -elem.max, elem.max)
    if getattr(recipe, "rounding", "nearest") == "stochastic":
        values = round_stochastic(v, elem, generator)
    else:
        values = round_nearest(v, elem)
    deq = values * decode.unsqueeze(-1)
    nonzero = blocks != 0
    per_block = {
        "scales": scales, "amax": amax, "scaled_amax": amax * enc,
        "nonzero": nonzero.sum(-1, dtype=torch.int32),
        "flushed": (nonzero & (deq == 0)).sum(-1, dtype=torch.int32),
    }
    values, deq = _from_blocks(values, xm.shape, k, two_d), _from_blocks(deq, xm.shape, k, two_d)
    if signs is not None:
        deq = rht_inverse(deq, signs)
    if not two_d:
        values, deq = values.movedim(-1, d), deq.movedim(-1, d)
        per_block = {name: t.movedim(-1, d) for name, t in per_block.items()}
    return BlockQuantized(values=values, dequantized=deq.to(x.dtype), tensor_scale=tensor_scale,
                          recipe=recipe, dim=d, **per_block)


def block_stats(q: BlockQuantized) -> dict[str, torch.Tensor]:
    """Per-cast statistics, as device tensors (no host sync):

    * ``blocks``: the number of blocks (int64, 0-dim);
    * ``clipped_share``: blocks whose max element was saturated, ``scaled_amax > elem_max``
      (finite amax and a nonzero scale), over all blocks;
    * ``clip_error_share``: the clipped blocks whose max element saturation changed, i.e. that
      would round (nearest-even, on the grid continued past the max) above ``elem_max``: E2M1
      from 7 up, E4M3 above 464, E5M2 from 61440 up. A max element in ``(6, 7)`` is saturated
      but lands on 6 either way; NVFP4's rounded E4M3 block scale saturates about half of the
      blocks that way (``scaled_amax <= 6 * 17/16``) with no clip error;
    * ``flushed_share``: nonzero elements dequantised to zero, over the nonzero elements (0 when
      there are none);
    * ``zero_scale_share``: blocks whose stored scale is 0 (NVFP4: the E4M3 block scale
      underflowed, the whole block is flushed); ``nonfinite_share``: blocks with a NaN/inf amax;
    * ``scale_exp_hist``: int64 counts of ``floor(log2 scale)`` over the blocks with a finite
      positive ``scales``, bin ``i`` = exponent ``SCALE_EXP_MIN + i`` (for MX and power-of-two
      scales the exact exponent; for NVFP4 the E4M3 block scale, 2^-9 .. 2^8).
    """
    s = q.scales
    n = torch.tensor(s.numel(), device=s.device)
    finite = torch.isfinite(q.amax)
    elem = q.recipe.element
    clipped = (q.scaled_amax > elem.max) & finite & (s > 0)
    clip_error = clipped & (round_nearest(q.scaled_amax, elem) > elem.max)
    ok = torch.isfinite(s) & (s > 0)
    _, e = torch.frexp(s)
    idx = torch.where(ok, torch.clamp(e.long() - 1 - SCALE_EXP_MIN, 0, SCALE_EXP_MAX - SCALE_EXP_MIN), 0)
    hist = torch.zeros(SCALE_EXP_MAX - SCALE_EXP_MIN + 1, dtype=torch.int64, device=s.device)
    hist.scatter_add_(0, idx.reshape(-1), ok.reshape(-1).long())
    nonzero = q.nonzero.sum(dtype=torch.int64)
    return {
        "blocks": n,
        "clipped_share": clipped.sum() / n,
        "clip_error_share": clip_error.sum() / n,
        "flushed_share": q.flushed.sum(dtype=torch.int64) / nonzero.clamp(min=1),
        "zero_scale_share": (s == 0).sum() / n,
        "nonfinite_share": (~finite).sum() / n,
        "scale_exp_hist": hist,
    }
