"""Checkpoints: atomic writes, ``weights_only`` loads, and every RNG state as plain tensors.

A checkpoint is one file, ``<run dir>/checkpoint.pt``, holding ``step``, the model, optimizer and
strategy ``state_dict``s, the RNG states (torch CPU, CUDA when present, NumPy, Python ``random``),
the data position (the step: batches are a function of ``(seed, step)``, see
``experiments/workloads/data.py``) and the loop's host counters. It is written to a temporary file in the
same directory, flushed to disk, then ``os.replace``d over the previous one, so a kill at any
moment leaves either the old or the new checkpoint, never a partial one.

Loading uses ``torch.load(weights_only=True)``: only tensors and plain containers/numbers are
accepted, so a checkpoint received from someone else cannot run code. That is why the NumPy and
Python RNG states are stored as int64 tensors rather than pickled tuples.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments import schema

__all__ = ["CheckpointError", "save", "load", "capture_rng", "restore_rng", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = schema.CHECKPOINT_NAME


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (truncated, corrupt, or from another run)."""


def save(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` onto the CPU.

    Raises:
        CheckpointError: one line naming the file, when it cannot be read or lacks ``step``.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read means the file is unusable
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt: {reason[:200]}); "
            "restore it or delete it to start this run from scratch"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"checkpoint {path} is not a scalelab checkpoint (no integer 'step')")
    return state


def capture_rng() -> dict[str, Any]:
    """Every RNG state as tensors and plain numbers (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_cached_gaussian": float(np_state[4]),
        "python_version": int(py_version),
        "python_state": torch.tensor(py_internal, dtype=torch.int64),
        "python_gauss": py_gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_cached_gaussian"],
        )
    )
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"].tolist()), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
