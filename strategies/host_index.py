"""Small constant tensors a step builds from host values every time (group indices, sizes): made
once per ``(values, dtype, device)`` and reused. After its first step a rule then makes no
host-to-device copy in ``backward``/``step``/``update``, which a CUDA graph cannot capture (a copy
from pageable host memory), and pays no tensor construction per call
(``tests/strategies/test_capturable.py``).

The cache keeps the last :data:`KEEP` keys, except those used while a CUDA stream was capturing:
a graph reads such a tensor on every replay through a raw pointer, without a reference, so
evicting it would hand its memory to other tensors while the graph still reads it (indices into
``scatter_reduce_``/``index_add_``: wrong sums or an illegal memory access). Those are kept for
the life of the process; a capture uses a fixed set of them.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["KEEP", "host_tensor", "pinned"]

KEEP = 512
"""How many recently used keys the cache keeps (apart from those a capture used)."""

_PINNED: dict[tuple[tuple[int | float, ...], torch.dtype, torch.device], torch.Tensor] = {}


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph capturing the work queued now on ``device``? (Looked up by name at each
    call, so a CPU test can stand in for a capture.)"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=KEEP)
def _made(values: tuple[int | float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def host_tensor(values: tuple[int | float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, cached and shared: callers only read it.
    Called during a CUDA graph capture, the tensor is kept for good (module docstring)."""
    key = (values, dtype, device)
    t = _PINNED.get(key)
    if t is None:
        t = _made(values, dtype, device)
        if capturing(device):
            _PINNED[key] = t
    return t


def pinned() -> int:
    """How many tensors a capture has pinned so far."""
    return len(_PINNED)
