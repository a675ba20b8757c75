"""Block-scaled cast recipes: one validated dataclass per recipe, its formula in the docstring.

A block-scaled cast splits a tensor into blocks of ``k`` elements (1 x k along one dim, or
k x k tiles of the last two dims), gives every block its own scale ``s`` and stores each element
as a narrow float ``q`` on the element grid, so that ``x ~ q * s``. The recipes differ in the
element format, the block shape, how ``s`` is derived from the block abs-max ``amax`` and how it
is rounded. :func:`strategies.blocks.quantize` implements them; this module only declares and
validates them, in the style of TransformerEngine's ``common/recipe/__init__.py`` (each field
declared once with :func:`strategies.params.hp`: default, allowed values, source).

Element formats (OCP "OCP 8-bit Floating Point Specification (OFP8)" and "OCP Microscaling
Formats (MX) v1.0", section 5.3): ``e4m3`` (max 448, 3 mantissa bits, smallest normal 2^-6),
``e5m2`` (max 57344, 2 bits, 2^-14) and ``e2m1`` (FP4: max 6, 1 bit, smallest normal 1, grid
0, 0.5, 1, 1.5, 2, 3, 4, 6). ``max_pow2`` is the exponent of the largest power of two of the
format (torchao ``prototype/mx_formats/constants.py``: ``F8E4M3_MAX_POW2 = 8`` etc.).

Sources, by the names the docstrings use:

* OCP MX v1.0: opencompute.org "OCP Microscaling Formats (MX) Specification v1.0" (2023).
* torchao: pytorch/ao ``torchao/prototype/mx_formats/{mx_tensor.py,config.py,constants.py}``
  (``to_mx``, ``ScaleCalculationMode``), release 0.18.0.
* TE: NVIDIA/TransformerEngine ``transformer_engine/common/recipe/__init__.py``
  (``MXFP8BlockScaling``, ``Float8BlockScaling``, ``NVFP4BlockScaling``), the pages
  ``docs/features/low_precision_training/{mxfp8,fp8_blockwise_scaling,nvfp4}/*.rst``, the kernels'
  scale rules ``common/recipe/recipe_common.cuh`` (``compute_scale_from_amax``) and
  ``common/cast/nvfp4/core_nvfp4.cuh``, and the Python reference
  ``pytorch/custom_recipes/reference_nvfp4.py``.
* DeepSeek-V3: arXiv 2412.19437, section 3.3 (1x128 activation tiles, 128x128 weight blocks).
* NVFP4 paper: "Pretraining Large Language Models with NVFP4", arXiv 2509.25149.
* Megatron-LM: ``megatron/core/transformer/transformer_config.py``, ``fp8_recipe`` in
  ``tensorwise | delayed | mxfp8 | blockwise | custom`` and ``fp4_recipe = "nvfp4"``
  (``--fp8-recipe`` / ``--fp4-recipe``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from strategies import validation as v
from strategies.params import hp

__all__ = [
    "ELEMENTS",
    "FP8Blockwise",
    "MX",
    "NVFP4",
    "NVFP4_TE_ROLES",
    "Element",
    "Recipe",
    "SCALE_ROUNDINGS",
]


class Element(NamedTuple):
    """A narrow float element format: its largest finite value, mantissa bits, the exponent of
    its smallest normal value (subnormals share that exponent's spacing) and the exponent of its
    largest power of two."""

    name: str
    max: float
    mbits: int
    emin: int
    max_pow2: int


ELEMENTS = {
    "e4m3": Element("e4m3", 448.0, 3, -6, 8),
    "e5m2": Element("e5m2", 57344.0, 2, -14, 15),
    "e2m1": Element("e2m1", 6.0, 1, 0, 2),
}
"""The element formats by name (OCP OFP8; OCP MX v1.0 section 5.3.3 for E2M1)."""

SCALE_ROUNDINGS = ("floor", "ceil", "even", "rceil")
"""torchao's ``ScaleCalculationMode`` values, lower case."""


def _int_choice(*choices: int) -> v.Check:
    """An integer among ``choices`` (bools refused): ``block_size must be one of 16, 32, got 7``."""

    def check(field: str, value: Any) -> int:
        if isinstance(value, bool) or value not in choices:
            v.fail(field, "one of " + ", ".join(str(c) for c in choices), value)
        return int(value)

    return check


@dataclass(frozen=True)
class Recipe:
    """Base of the recipes: every field declared with ``hp`` is checked (and normalised) at
    construction, then :meth:`check` runs the cross-field rules."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Cross-field checks (none by default)."""

    @property
    def element(self) -> Element:
        return ELEMENTS[getattr(self, "elem")]

    @property
    def block_shape(self) -> tuple[int, int]:
        """``(1, k)`` for 1-D blocks, ``(k, k)`` for 2-D tiles."""
        k = getattr(self, "block_size")
        return (k, k) if getattr(self, "block_dims", 1) == 2 else (1, k)


@dataclass(frozen=True)
class MX(Recipe):
    """OCP Microscaling (MXFP8 with ``e4m3``/``e5m2``, MXFP4 with ``e2m1``): one E8M0 scale
    ``X = 2^e`` per ``k`` consecutive elements along the block dim, ``q = elem(x / X)``.

    ``amax`` is the block abs-max in fp32 and ``E(a)`` the unbiased exponent field of the fp32 ``a``
    (``floor(log2 a)`` for a normal ``a``, -127 for a subnormal one). With ``p = max_pow2`` of the
    element format (8 for E4M3, 15 for E5M2, 2 for E2M1), torchao's ``ScaleCalculationMode``:

    * ``floor`` (the OCP MX v1.0 section 6.3 rule): ``e = E(amax) - p``. The block max lands in
      ``[2^p, 2^(p+1))`` and is saturated where that exceeds the format max (E4M3: above 448;
      E2M1: above 6, the clipping AMD reports for ~37% of FP4 blocks, ROCm/aiter PR 3212).
    * ``ceil``: ``e = E(amax) + [mantissa(amax) != 0] - p``: never clips, may waste a binade.
    * ``even``: ``floor`` applied to ``amax`` first rounded to the element's mantissa width
      (torchao adds ``2^(22 - mbits)`` to the fp32 bits of ``amax`` and truncates the mantissa).
    * ``rceil`` (cuBLAS "block quantization", TE's MXFP8 cast via ``cvt.rp.satfinite.ue8m0x2``):
      ``e = ceil(log2(amax / elem_max))``, exactly (from the fp32 bits), clamped to [-127, 127].

    Stored scales are clamped to E8M0's range [2^-127, 2^127]; a NaN block gets the E8M0 NaN code
    (its dequantised block is NaN). torchao's edge rules are kept (see
    :mod:`strategies.blocks`). Defaults: ``e4m3`` and ``k = 32`` (OCP MX v1.0 section 5, TE
    ``MXFP8BlockScaling``), ``floor`` (OCP rule; torchao's default ``ScaleCalculationMode.FLOOR``;
    TE and Megatron's ``--fp8-recipe mxfp8`` use ``rceil``).
    """

    elem: str = hp("e4m3", v.choice(*ELEMENTS), "OCP MX v1.0 section 5; torchao SUPPORTED_ELEM_DTYPES",
                   "element format: e4m3 / e5m2 (MXFP8) or e2m1 (MXFP4)")
    block_size: int = hp(32, _int_choice(16, 32, 64, 128), "OCP MX v1.0 section 5: k = 32",
                         "elements per block along the block dim")
    scale_rounding: str = hp("floor", v.choice(*SCALE_ROUNDINGS),
                             "OCP MX v1.0 section 6.3; torchao ScaleCalculationMode",
                             "how the E8M0 exponent is rounded: floor, ceil, even or rceil")
    rounding: str = hp("nearest", v.choice("nearest", "stochastic"), "OCP MX v1.0 section 6.3 (nearest); "
                       "arXiv 2506.08027 (stochastic for MXFP4 gradients)", "rounding of the values")


@dataclass(frozen=True)
class FP8Blockwise(Recipe):
    """FP8 blockwise scaling (DeepSeek-V3 section 3.3; TE ``Float8BlockScaling``): one fp32
    scale per 1 x 128 run (activations, gradients) or 128 x 128 tile (weights).

    TE's rule (``compute_scale_from_amax`` in ``common/recipe/recipe_common.cuh``, restated in
    ``docs/features/low_precision_training/fp8_blockwise_scaling``): ``a = max(amax, eps)``;
    ``s = fmt_max / a`` (IEEE fp32 division), except ``s = 1`` where ``a`` is 0, inf or NaN,
    and ``s = finfo(x.dtype).max`` where the quotient overflows; with ``pow2_scales`` the mantissa
    bits of ``s`` are zeroed (rounded down to a power of two). ``q = elem(clamp(x * s, +-max))``,
    stored decode scale ``1 / s``, ``x ~ q * (1 / s)``.

    Defaults: ``e4m3`` (TE ``fp8_format = E4M3``; its ``HYBRID`` is ``e5m2`` for gradients),
    ``k = 128`` (TE docs "Block size is 128"; DeepSeek-V3), 1-D blocks (TE
    ``x_block_scaling_dim = grad_block_scaling_dim = 1``; weights use ``block_dims=2``,
    ``w_block_scaling_dim = 2``), power-of-two scales (TE ``power_2_scale = not
    use_f32_scales``; ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` keeps fp32 scales), ``eps = 0``
    (TE ``QParams.amax_epsilon``). Megatron-LM: ``--fp8-recipe blockwise``.
    """

    elem: str = hp("e4m3", v.choice("e4m3", "e5m2"), "TE Float8BlockScaling.fp8_format",
                   "element format")
    block_size: int = hp(128, _int_choice(16, 32, 64, 128), "TE fp8_blockwise_scaling docs; DeepSeek-V3 3.3",
                         "block length k")
    block_dims: int = hp(1, _int_choice(1, 2), "TE Float8BlockScaling.{x,w,grad}_block_scaling_dim",
                         "1: 1 x k blocks along the block dim; 2: k x k tiles of the last two dims")
    pow2_scales: bool = hp(True, v.boolean, "TE QParams.power_2_scale (default not use_f32_scales)",
                           "round the scale down to a power of two")
    amax_epsilon: float = hp(0.0, v.between(0.0, float("inf"), "[)"), "TE QParams.amax_epsilon",
                             "floor of amax in the scale")
    rounding: str = hp("nearest", v.choice("nearest", "stochastic"), "TE (nearest; stochastic only in NVFP4)",
                       "rounding of the values")


@dataclass(frozen=True)
class NVFP4(Recipe):
    """NVFP4 (TE ``NVFP4BlockScaling``; NVFP4 paper): E2M1 values, an E4M3 scale per 16
    elements (1 x 16) or per 16 x 16 tile, times one fp32 tensor scale.

    TE's rule (``core_nvfp4.cuh``, ``reference_nvfp4.py``), ``A`` the tensor abs-max, fp32
    arithmetic, ``fl(1/6)`` the rounded reciprocal:

    * ``S_enc = min(448 * 6 / A, FLT_MAX)``, ``S_enc = 1`` where ``A`` is 0 or the quotient is 0
      (``A = inf``); ``S_dec = 1 / S_enc`` (the tensor scale the docs write ``A / (448 * 6)``);
    * per block ``s_b = e4m3(clamp(amax * (S_enc * fl(1/6)), +-448))`` (round to nearest even);
    * ``q = e2m1(clamp(x * min(1 / (s_b * S_dec), FLT_MAX), +-6))``, nearest-even or stochastic;
    * dequantised (TE's ``dequantize_fp4_kernel``): ``x ~ q * ((s_b * A) * fl(1 / 2688))``.

    ``rht`` applies the 16-point random Hadamard transform ``x' = x H``, ``H = S H_16 / 4``
    (``S`` a fixed diagonal of signs) along the block dim before the cast and ``H^T`` after it
    (TE ``docs/.../nvfp4.rst`` "Random Hadamard Transform"); ``rht_seed=None`` uses TE's fixed
    signs (``get_wgrad_sign_vector`` in ``reference_nvfp4.py``), an integer draws 16 signs from
    ``torch.Generator().manual_seed(rht_seed)``.

    torchao's ``nvfp4_quantize`` agrees where ``s_b >= 2^-6`` but clamps ``s_b`` to 2^-6 (the
    smallest normal E4M3) where TE keeps E4M3 subnormals and 0 (a flushed block), and computes the
    encode multiplier as ``(1 / (A / 2688)) / s_b``, an fp32 ulp off TE's at times.

    Defaults: the plain cast (1-D, nearest, no RHT); TE applies 2-D tiles to weights, stochastic
    rounding to gradients and RHT to the column-wise (wgrad) copies of inputs and gradients:
    :data:`NVFP4_TE_ROLES`. Megatron-LM: ``--fp4-recipe nvfp4``.
    """

    block_dims: int = hp(1, _int_choice(1, 2), "TE NVFP4BlockScaling.disable_2d_quantization",
                         "1: 1 x 16 blocks; 2: 16 x 16 tiles (weights)")
    rounding: str = hp("nearest", v.choice("nearest", "stochastic"),
                       "TE NVFP4BlockScaling.disable_stochastic_rounding", "rounding of the values")
    rht: bool = hp(False, v.boolean, "TE NVFP4BlockScaling.disable_rht", "16-point random Hadamard transform")
    rht_seed: Optional[int] = hp(None, v.optional(v.integer(0)), "TE get_wgrad_sign_vector (None)",
                                 "seed of the RHT signs; None: TE's fixed signs")
    elem = "e2m1"
    block_size = 16

    def check(self) -> None:
        if self.rht and self.block_dims != 1:
            raise ValueError(f"rht needs block_dims=1 (TE applies it to 1-D blocks only), got {self.block_dims}")


NVFP4_TE_ROLES = {
    "weight": NVFP4(block_dims=2),
    "input": NVFP4(),
    "input_columnwise": NVFP4(rht=True),
    "grad": NVFP4(rounding="stochastic"),
    "grad_columnwise": NVFP4(rounding="stochastic", rht=True),
}
"""TE's default NVFP4 cast of each GEMM operand (``NVFP4BlockScaling.__post_init__``:
``fp4_quant_fwd_weight`` 2-D, ``fp4_quant_fwd_inp`` RHT, ``fp4_quant_bwd_grad`` RHT and
stochastic rounding; RHT "is currently only applied to column-wise usage")."""
