"""A recorded run's trace for the replay tools: ``RUN_DIR/trace.jsonl`` or a trace file itself."""

from __future__ import annotations

from pathlib import Path

from experiments import schema
from strategies.tracing import Trace, TraceError

__all__ = ["ReplayError", "load_trace"]


class ReplayError(Exception):
    """A run directory or command line the replay cannot use (one line)."""


def load_trace(run_dir: Path) -> Trace:
    """The run's trace (``RUN_DIR/trace.jsonl``, or a trace file itself, e.g. written by
    ``strategies.watch.Watch.save``); :class:`ReplayError` when missing or unreadable."""
    if run_dir.is_file():
        path = run_dir
    elif not run_dir.is_dir():
        raise ReplayError(f"run directory {run_dir} does not exist or is not a directory")
    else:
        path = run_dir / schema.TRACE_NAME
    if not path.is_file():
        raise ReplayError(f"{run_dir} has no {schema.TRACE_NAME} (a run from before traces, or train.trace=false)")
    try:
        trace = Trace.from_lines(path.read_text(encoding="utf-8").splitlines())
    except (TraceError, OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"{path}: corrupt trace: {exc}") from None
    if not len(trace):
        raise ReplayError(f"{path}: the trace holds no step yet")
    return trace
