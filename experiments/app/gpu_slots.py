"""GPU slot locks for ``device=cuda:free``: one exclusive, host-wide lock file per GPU.

Several single-process jobs sharing a multi-GPU host (the joblib launcher, or several sweeps at
once) each take a GPU no other scalelab process holds. A lock is ``flock(LOCK_EX | LOCK_NB)`` on
``<lock dir>/gpu-<name>.lock``; the kernel drops it when the fd is closed or the process dies, so
a crashed job frees its GPU. Locks are named after the physical device (the
``CUDA_VISIBLE_DEVICES`` entry, else the index), so processes with different visibility masks
still agree. Lock directory: ``$SCALELAB_GPU_LOCK_DIR``, default ``<tmp>/scalelab-gpu-locks``.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["claim_slot", "claim_free_gpu", "release_gpu"]

# The GPU this process holds: (index among the visible devices, open lock fd), until release_gpu().
_claimed: tuple[int, int] | None = None


def claim_slot(names: list[str], lock_dir: str | Path, timeout_s: float, poll_s: float = 0.5) -> tuple[int, int]:
    """Take an exclusive, host-wide claim on one of ``names``; return (its index, the lock's fd).

    The first name nobody holds wins; if all are held, poll until one is released or
    ``timeout_s`` passes. Close the fd (``release_gpu()`` does) to release it.

    Raises:
        TimeoutError: every name stayed claimed for ``timeout_s`` seconds.
    """
    if not names:
        raise ValueError("names must list at least one slot to claim, got []")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        for index, name in enumerate(names):
            fd = os.open(lock_dir / f"gpu-{name}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return index, fd
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no free GPU among {len(names)} after {timeout_s:.0f} s: every one is claimed by another "
                f"scalelab process (locks in {lock_dir}); run fewer jobs at once than GPUs"
            )
        time.sleep(poll_s)


def claim_free_gpu(timeout_s: float) -> int:
    """Index (among the visible devices) of a GPU no other scalelab process on this host holds.

    A process that already holds a GPU keeps it (a joblib worker reused for its next job).
    """
    global _claimed
    if _claimed is not None:
        return _claimed[0]
    count = torch.cuda.device_count()
    mask = [m.strip() for m in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if m.strip()]
    names = mask[:count] if len(mask) >= count else [str(i) for i in range(count)]
    lock_dir = os.environ.get("SCALELAB_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / "scalelab-gpu-locks"
    _claimed = claim_slot(names, lock_dir, timeout_s)
    return _claimed[0]


def release_gpu() -> None:
    """Give back the GPU this process claimed (no-op when it holds none)."""
    global _claimed
    if _claimed is not None:
        os.close(_claimed[1])
        _claimed = None
