"""A file of tensors made once and shared by every run that needs it: :func:`cached`.

Made by the first process that needs it, under an exclusive lock (``fcntl.flock`` on
``<file>.lock``), so two jobs of a parallel sweep never both make it: the second waits for the
lock, then finds the file and loads it. The file is written atomically (a temporary file in the
same directory, flushed and ``fsync``\\ ed, then ``os.replace``\\ d onto the name, as
:mod:`experiments.app.checkpoint` writes checkpoints), so a reader never sees half a file, and a
process killed while making it leaves no file (the next one makes it again). It is read with
``torch.load(weights_only=True)``: tensors and plain containers only, never code. A file that does
not load, or that ``check`` refuses, is a one-line :class:`CacheError` naming it and the fix
(delete it); it is never silently replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["CacheError", "atomic_save", "cached", "file_lock", "load"]


class CacheError(RuntimeError):
    """A cached file exists but cannot be used; the message is one line naming the file."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def atomic_save(path: Path, obj: dict[str, Any]) -> None:
    """``torch.save(obj)`` to ``path`` atomically (a temporary file beside it, fsync, ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, check: Callable[[dict[str, Any]], str | None] | None = None) -> dict[str, Any]:
    """The dict saved at ``path`` (``weights_only=True``); ``check(obj)`` returns why it is unusable
    (``None``: usable). Raises :class:`CacheError` (one line) when it does not load or is refused."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the reason, the file is unusable
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CacheError(f"cached file {path} is unreadable (truncated or corrupt: {why}); delete it and the "
                         "next run makes it again") from None
    reason = "it holds no dict" if not isinstance(obj, dict) else None if check is None else check(obj)
    if reason is not None:
        raise CacheError(f"cached file {path} does not match what this run needs ({reason}); delete it and "
                         "the next run makes it again")
    return obj


def cached(path: Path, make: Callable[[], dict[str, Any]],
           check: Callable[[dict[str, Any]], str | None] | None = None) -> tuple[dict[str, Any], bool]:
    """``(obj, made)``: the file at ``path`` loaded, or made by ``make()`` and saved first (``made``
    true) when missing, under the lock ``<path>.lock`` (module docstring)."""
    path = Path(path)
    if path.exists():
        return load(path, check), False
    with file_lock(path.with_name(path.name + ".lock")):
        if path.exists():  # another process made it while this one waited for the lock
            return load(path, check), False
        atomic_save(path, make())
    return load(path, check), True
