"""Run a function on N gloo ranks (spawned processes, a ``file://`` rendezvous) and collect what
each rank returns. The process group's timeout turns a hang into a failure."""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _entry(rank: int, body: Callable[[int], Any], tmp: str, world: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        out = body(rank)
        torch.save(out, f"{tmp}/rank{rank}.pt")
        gc.collect()  # DDP wrappers and hooks left in reference cycles go while the group is still up
        dist.barrier()  # no rank leaves the group while another still talks to it
    finally:
        dist.destroy_process_group()


def run_ranks(body: Callable[[int], Any], tmp: Path, world: int = 2, timeout_s: float = 60.0) -> list[Any]:
    """``[body(0), ..., body(world - 1)]``, each run on its own rank (``body`` must be picklable:
    a module-level function, or a ``functools.partial`` of one)."""
    try:
        torch.multiprocessing.spawn(_entry, args=(body, str(tmp), world, timeout_s), nprocs=world, join=True)
    except torch.multiprocessing.ProcessExitedException as exc:
        saved = [r for r in range(world) if (Path(tmp) / f"rank{r}.pt").exists()]
        if saved == list(range(world)):  # seen twice in full suites, never alone: say where it died
            raise RuntimeError(f"{exc}, after every rank had saved its result: in the barrier, "
                               "destroy_process_group or interpreter exit, not in the body") from exc
        raise
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
