"""``scalelab-bench --device cuda`` section (iii): the per-layer rules attached vs not on the GPU.

Section (c) of the CPU bench (:func:`experiments.bench.steps.bench_hooks`: a training step of the
character GPT, forward + scaled backward + unscale_/step (no-op optimizer)/update, one copy with the
rule attached and one without, in shuffled order round by round) on ``cuda``, timed by the host
clock with a ``torch.cuda.synchronize()`` at both ends of each step: the step's kernels and its
launches, the boundary hooks' Python included. The ratio is the median over rounds of attached /
plain in the same round.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from experiments.bench.steps import bench_hooks, interval_text

__all__ = ["bench_hooks_gpu", "format_hooks_table", "synced_clock"]


def synced_clock() -> float:
    """``time.perf_counter()`` once the device has finished the work queued so far."""
    torch.cuda.synchronize()
    return time.perf_counter()


def bench_hooks_gpu(repeats: int, models: tuple[str, ...] = ("gpt",)) -> list[dict[str, Any]]:
    """Section (c) on ``cuda`` with :func:`synced_clock` (rows as :func:`bench_hooks` returns)."""
    return bench_hooks(repeats, models, device="cuda", clock=synced_clock)


def _mib(row: dict[str, Any], key: str, sign: str = "") -> str:
    return "-" if key not in row else f"{row[key]:{sign}.1f}"


def format_hooks_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (median ms, the ratio and its 95 % interval, the peak memory of
    one plain step and what the attached one held beyond it)."""
    lines = ["| model | rule | plain ms | attached ms | extra ms | attached / plain | 95% interval | peak MiB | +MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['strategy']} | {r['plain_ms']:.3f} | {r['attached_ms']:.3f} | "
              f"{r['extra_ms']:.3f} | {r['ratio']:.3f}x | {interval_text(r)} | {_mib(r, 'plain_peak_mib')} | "
              f"{_mib(r, 'extra_peak_mib', '+')} |" for r in rows]
    return "\n".join(lines)
