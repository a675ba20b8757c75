"""The number-format constants the rules and the statistics share, and the power-of-two grid.

IEEE 754 binary16 (fp16): 5 exponent bits (bias 15), 10 fraction bits. Its largest finite value
is ``(2 - 2^-10) * 2^15 = 65504``; its smallest positive normal value is ``2^-14``; below that,
values are subnormal (``k * 2^-24``, precision falls with every halving) or zero. A scale that is
a power of two multiplies every finite value of a binary format exactly (only the exponent
changes), which is why several rules keep their scales on that grid (Micikevicius et al. 2018,
"Mixed Precision Training", arXiv 1710.03740, section 3.2).

The CUDA kernels carry the same numbers in ``cuda/include/`` (``round_down_pow2`` in
``rules/shared.h``; the 2^-14 threshold of the statistics pass).
"""

from __future__ import annotations

import torch

__all__ = ["FP16_MAX", "FP16_MIN_NORMAL", "round_down_pow2"]

FP16_MAX = 65504.0
"""Largest finite float16, ``(2 - 2^-10) * 2^15``."""

FP16_MIN_NORMAL = 2.0**-14
"""Smallest positive normal float16; below it values are subnormal (precision loss) or zero."""


def round_down_pow2(x: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``x`` (elementwise, exact: via ``frexp``, x = m * 2^e, m in [0.5, 1)).

    Non-positive and non-finite inputs are returned unchanged."""
    _, e = torch.frexp(x)
    p = torch.ldexp(torch.full_like(x, 0.5), e)
    return torch.where(torch.isfinite(x) & (x > 0), p, x)
