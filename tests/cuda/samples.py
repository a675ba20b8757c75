"""Argument lists for every op of ``torch.ops.scalelab`` (fresh tensors on each call), shared by
the opcheck and dispatch tests, and each update op's Python twin. Each update op's argument list
is also its twin's. A new rule's op adds its twin to TWINS and its cases to SAMPLES."""

from __future__ import annotations

from typing import Any, Callable

import torch

from strategies.layerwise import layerwise_update_
from strategies.max_ema import max_ema_update_
from strategies.native import native_update_
from strategies.norm_ratio import norm_ratio_update_
from tests.cuda.gradients import make_grads

F32, I32, I64 = torch.float32, torch.int32, torch.int64


def _native(found: float, hysteresis: int) -> tuple[Any, ...]:
    return (torch.tensor(2.0**16), torch.tensor(2, dtype=I32), torch.tensor(hysteresis, dtype=I32),
            torch.tensor(found), 2.0, 0.5, 3, hysteresis)


def _max_ema(G: int, found: float, cap: bool, broadcast: bool) -> tuple[Any, ...]:
    absmax = torch.exp2(torch.arange(G, dtype=F32) - 3.0)
    found_t = torch.tensor(found) if broadcast else torch.full((G,), found)
    return (torch.full((G,), 2.0**15), torch.full((G,), 2.0**14), torch.ones(G, dtype=I32),
            torch.zeros(G, dtype=I32), torch.zeros(G), found_t, absmax,
            32768.0, 0.9, 3.0, 0.5, 1, False, True, cap)


def _norm_ratio(probed: bool, found: float) -> tuple[Any, ...]:
    return (torch.tensor(2.0**16), torch.tensor(0, dtype=I32), torch.tensor(0.5), torch.tensor(1, dtype=I32),
            torch.tensor(float("nan")), torch.tensor(found), torch.tensor(64.0), torch.tensor(0.25), probed,
            2.0, 0.5, 2000, 8.0, 0.125, 0.9)


def _layerwise(rule: str, found: float, cap: bool, bounds: tuple[float | None, float | None]) -> tuple[Any, ...]:
    G = 3
    return (torch.full((G,), 2.0**15), torch.zeros(G, dtype=I32), torch.full((G,), 2.0**16),
            torch.ones(G, dtype=I32), torch.ones(G, dtype=I32), torch.zeros(G), torch.zeros(G),
            torch.tensor(found), torch.tensor([0.0, found, 0.0]), torch.tensor([0.5, 2.0, 0.0]),
            torch.tensor([10, 10, 0], dtype=I64), torch.zeros(G), torch.zeros(G),
            rule, 32768.0, 0.9, 2.0, 0.5, 1, True, *bounds, cap)


def _stats(dtype: torch.dtype, groups: bool) -> tuple[Any, ...]:
    grads = make_grads([7, 100, 0, 33], dtype, seed=3, specials=("zero", "fp16_min_sub"),
                       layouts=("contiguous", "strided"))
    if groups:
        return (grads, torch.tensor([0.25, 1.0]), [0, 1, 1, 0], 2)
    return (grads, torch.tensor(0.375), [], 1)


SAMPLES: dict[str, list[Callable[[], tuple[Any, ...]]]] = {
    "native_update_": [lambda: _native(0.0, 1), lambda: _native(1.0, 1), lambda: _native(1.0, 3)],
    "max_ema_update_": [lambda: _max_ema(1, 0.0, False, True), lambda: _max_ema(4, 0.0, False, False),
                        lambda: _max_ema(4, 1.0, True, True), lambda: _max_ema(2, 1.0, True, False)],
    "norm_ratio_update_": [lambda: _norm_ratio(False, 0.0), lambda: _norm_ratio(True, 0.0),
                           lambda: _norm_ratio(True, 1.0)],
    "layerwise_update_": [lambda: _layerwise("max_ema", 0.0, False, (None, None)),
                          lambda: _layerwise("max_ema", 1.0, True, (1.0, 2.0**20)),
                          lambda: _layerwise("backoff_growth", 1.0, False, (None, 2.0**18))],
    "unscale_and_stats": [lambda: _stats(torch.float32, False), lambda: _stats(torch.float16, True),
                          lambda: _stats(torch.bfloat16, True)],
}
"""op name -> argument-list factories (every op of the library, several cases each)."""

TWINS: dict[str, Callable[..., None]] = {
    "native_update_": native_update_,
    "max_ema_update_": max_ema_update_,
    "norm_ratio_update_": norm_ratio_update_,
    "layerwise_update_": layerwise_update_,
}
"""update op -> its Python twin (same positional arguments; the oracle of the op)."""
