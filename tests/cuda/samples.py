"""Argument lists for every op of ``torch.ops.scalelab`` (fresh tensors on each call), shared by
the opcheck and dispatch tests, and each update op's Python twin. Each update op's argument list
is also its twin's. A new rule's op adds its twin to TWINS and its cases to SAMPLES."""

from __future__ import annotations

from typing import Any, Callable

import torch

from strategies.rules.adaloss import adaloss_step_
from strategies.rules.amax_history import amax_history_update_
from strategies.formats import FP16_MIN_NORMAL
from strategies.rules.hybrid import hybrid_update_
from strategies.rules.layerwise import layerwise_update_
from strategies.rules.learned import learned_update_
from strategies.rules.max_ema import max_ema_update_
from strategies.rules.native import native_update_
from strategies.state import record_step_
from strategies.rules.norm_ratio import norm_ratio_update_
from strategies.rules.tolerance import tolerance_update_
from strategies.rules.underflow_target import E_BINS, underflow_target_update_
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


def _amax_history(found: float, most_recent: bool, L: int) -> tuple[Any, ...]:
    return (torch.tensor(2.0**10), torch.exp2(torch.arange(L, dtype=F32) - 4.0), torch.tensor(found),
            torch.tensor([0.25, 3.0]), 65504.0, 65504.0 * 2.0**-1, 0.5, most_recent)


def _hybrid(probed: bool, scheduled: bool, found: float, zero_jump: float | None) -> tuple[Any, ...]:
    return (torch.tensor(2.0**12), torch.tensor(2.0**13), torch.tensor(1, dtype=I32), torch.tensor(0, dtype=I32),
            torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0, dtype=I32), torch.tensor(float("nan")),
            torch.tensor(0, dtype=I64), torch.tensor(0.0), torch.tensor(0.0), torch.tensor(found),
            torch.tensor([8.0, 2.0]), torch.tensor(0.5), torch.tensor(256.0), torch.tensor(1.0), probed, scheduled,
            32768.0, 0.5, 2.0, 0.5, 1, True, True, False, zero_jump, 8.0, 0.125, 0.0)


def _learned(found: float, G: float, interval: int) -> tuple[Any, ...]:
    return (torch.tensor(2.0**10), torch.tensor(0, dtype=I32), torch.tensor(0.5), torch.tensor(2.0),
            torch.tensor(3, dtype=I32), *(torch.tensor(0.0) for _ in range(4)), torch.tensor(found),
            torch.tensor([G, G / 4]), torch.tensor(0.25), 32768.0, 2.0, 1.0, 0.5, 0.5, 1e-8, 2.0, 0.5, interval)


def _underflow_target(found: float, observed: bool, filled: bool) -> tuple[Any, ...]:
    hist = torch.zeros(E_BINS)
    if filled:
        hist[120:160] = torch.arange(40, dtype=F32)
    return (torch.tensor(2.0**15), hist, torch.tensor(found), 1e-3, 32768.0, FP16_MIN_NORMAL, 2.0, 0.5, 32, observed)


def _tolerance(found: float, tolerance: float, threshold: float | None, raise_: bool,
               window: int | None = None) -> tuple[Any, ...]:
    """S = 2^14, t = interval - 1 (a clean step grows), r = 2, o = 0 (an overflow is 1/2 of r);
    ``window``: metaseq's growth window w (t + 1 = 3 grows when w divides 3)."""
    fault = torch.tensor(0, dtype=I64) if raise_ else None
    w = None if window is None else torch.tensor(window, dtype=I64)
    return (torch.tensor(2.0**14), torch.tensor(2, dtype=I32), torch.tensor(2, dtype=I64), torch.tensor(0, dtype=I64),
            torch.tensor(found), 2.0, 0.5, 3, tolerance, threshold, fault, 2.0**13 if raise_ else 1e-4, 7, w)


def _adaloss_step(found: float, blame: bool, bounds: tuple[float | None, float | None]) -> tuple[Any, ...]:
    """Four groups, the loss-side one last; group 1 without weight matrices (w2 = wmax = fan = 1)."""
    G = 4
    g2 = torch.tensor([1e-12, 4e-10, 0.0, 2e-6])
    return (torch.tensor([64.0, 16.0, 4.0, 1.0]), torch.zeros(G), g2, torch.tensor([100.0, 50.0, 0.0, 10.0]),
            torch.tensor([3e-6, 1e-4, 0.0, 5e-3]), torch.tensor(found), torch.tensor([0.0, found if blame else 0.0, 0.0, 0.0]),
            torch.zeros(G), torch.zeros(G), torch.tensor([1e-3, 1.0, 4e-2, 1e-2]), torch.tensor([0.1, 1.0, 0.5, 0.3]),
            torch.tensor([512.0, 1.0, 64.0, 32.0]), 3.2905267314918945, 6e-8, 65504.0, 16.0, 1024.0, 0.5, *bounds)


def _record_step(G: int, found: float, bounds: tuple[float | None, float | None]) -> tuple[Any, ...]:
    """Scales below, inside, above and NaN against the bounds; a step already skipped twice."""
    scale = torch.tensor([2.0**-20, 3.0, 2.0**40, float("nan")][:G])
    return (scale, torch.tensor(2, dtype=I64), torch.tensor(1.0 - found), torch.tensor(found), *bounds)


def _count_fraction(G: int, more: bool) -> tuple[Any, ...]:
    numel = torch.arange(3, 3 + G, dtype=I64) * 1000 + 7
    return (numel, numel // 3, numel // 5 if more else None)


def _stats(dtype: torch.dtype, groups: bool) -> tuple[Any, ...]:
    grads = make_grads([7, 100, 0, 33], dtype, seed=3, specials=("zero", "fp16_min_sub"),
                       layouts=("contiguous", "strided"))
    if groups:
        return (grads, torch.tensor([0.25, 1.0]), [0, 1, 1, 0], 2)
    return (grads, torch.tensor(0.375), [], 1)


def _boundary(dtype: torch.dtype, rescale: bool, special: str = "zero") -> tuple[Any, ...]:
    """One activation gradient (a strided one: the op reads a dense copy), and for the rescale a
    3 x 3 ratio table and the flat index of one entry."""
    (g,) = make_grads([1000], dtype, seed=5, specials=(special, "fp16_min_sub"), layouts=("strided",))
    return (g, torch.tensor([[1.0, 0.5, 2.0**-7], [2.0, 1.0, 0.25], [2.0**7, 4.0, 1.0]]), 5) if rescale else (g,)


SAMPLES: dict[str, list[Callable[[], tuple[Any, ...]]]] = {
    "native_update_": [lambda: _native(0.0, 1), lambda: _native(1.0, 1), lambda: _native(1.0, 3)],
    "max_ema_update_": [lambda: _max_ema(1, 0.0, False, True), lambda: _max_ema(4, 0.0, False, False),
                        lambda: _max_ema(4, 1.0, True, True), lambda: _max_ema(2, 1.0, True, False)],
    "norm_ratio_update_": [lambda: _norm_ratio(False, 0.0), lambda: _norm_ratio(True, 0.0),
                           lambda: _norm_ratio(True, 1.0)],
    "layerwise_update_": [lambda: _layerwise("max_ema", 0.0, False, (None, None)),
                          lambda: _layerwise("max_ema", 1.0, True, (1.0, 2.0**20)),
                          lambda: _layerwise("backoff_growth", 1.0, False, (None, 2.0**18))],
    "amax_history_update_": [lambda: _amax_history(0.0, False, 4), lambda: _amax_history(0.0, True, 1),
                             lambda: _amax_history(1.0, False, 3)],
    "hybrid_update_": [lambda: _hybrid(True, True, 0.0, 0.1), lambda: _hybrid(False, False, 0.0, 0.1),
                       lambda: _hybrid(True, False, 1.0, None)],
    "learned_update_": [lambda: _learned(0.0, 8.0, 1), lambda: _learned(1.0, float("inf"), 1),
                        lambda: _learned(0.0, 0.0, 3)],
    "underflow_target_update_": [lambda: _underflow_target(0.0, True, True), lambda: _underflow_target(0.0, True, False),
                                 lambda: _underflow_target(1.0, False, True)],
    "tolerance_update_": [lambda: _tolerance(0.0, 0.0, None, False), lambda: _tolerance(1.0, 0.25, 2.0**13.5, False),
                          lambda: _tolerance(1.0, 0.5, None, True), lambda: _tolerance(0.0, 0.0, None, False, 3),
                          lambda: _tolerance(1.0, 0.25, None, True, 5)],
    "adaloss_step_": [lambda: _adaloss_step(0.0, False, (None, None)), lambda: _adaloss_step(1.0, True, (None, 2.0**8)),
                      lambda: _adaloss_step(1.0, False, (2.0, 2.0**20))],
    "record_step_": [lambda: _record_step(1, 0.0, (None, None)), lambda: _record_step(4, 1.0, (1.0, 2.0**24)),
                     lambda: _record_step(3, 2.0, (0.1, 1e-3))],
    "count_fraction": [lambda: _count_fraction(1, False), lambda: _count_fraction(3, True),
                       lambda: (torch.zeros(2, dtype=I64), torch.zeros(2, dtype=I64), None)],
    "boundary_rescale": [lambda: _boundary(torch.float32, True), lambda: _boundary(torch.float16, True, "inf"),
                         lambda: _boundary(torch.bfloat16, True)],
    "grad_extremes": [lambda: _boundary(torch.float32, False, "-inf"), lambda: _boundary(torch.float16, False)],
    "exponent_histogram": [lambda: _boundary(torch.float32, False), lambda: _boundary(torch.bfloat16, False, "inf")],
    "unscale_and_stats": [lambda: _stats(torch.float32, False), lambda: _stats(torch.float16, True),
                          lambda: _stats(torch.bfloat16, True)],
}
"""op name -> argument-list factories (every op of the library, several cases each)."""

TWINS: dict[str, Callable[..., None]] = {
    "native_update_": native_update_,
    "max_ema_update_": max_ema_update_,
    "norm_ratio_update_": norm_ratio_update_,
    "layerwise_update_": layerwise_update_,
    "amax_history_update_": amax_history_update_,
    "hybrid_update_": hybrid_update_,
    "learned_update_": learned_update_,
    "underflow_target_update_": underflow_target_update_,
    "tolerance_update_": tolerance_update_,
    "adaloss_step_": adaloss_step_,
    "record_step_": record_step_,
}
"""update op -> its Python twin (same positional arguments; the oracle of the op)."""
