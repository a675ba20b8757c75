"""Small constant tensors a step builds from host values every time (group indices, sizes): made
once per ``(values, dtype, device)`` and reused. After its first step a rule then makes no
host-to-device copy in ``backward``/``step``/``update``, which a CUDA graph cannot capture (a copy
from pageable host memory), and pays no tensor construction per call
(``tests/strategies/test_capturable.py``)."""

from __future__ import annotations

import functools

import torch

__all__ = ["host_tensor"]


@functools.lru_cache(maxsize=512)
def host_tensor(values: tuple[int | float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, cached and shared: callers only read it."""
    return torch.tensor(values, dtype=dtype, device=device)
