"""The run's statistics trace file (``trace.jsonl``, :data:`experiments.schema.TRACE_NAME`).

:class:`TraceFile` wraps the library's :class:`strategies.tracing.TraceRecorder` (which the step
feeds: :func:`experiments.app.step.train_step`) and writes its chunks: the header at the start, one
chunk at every train line (with the activation-gradient histogram of that line, when measured), at
every checkpoint and at the end. Under a low-precision autocast (fp16, bf16, the fp8 modes' bf16) the
recorder hooks the model's leaf modules for the forward activation abs-max (``act_absmax``;
``train.trace_act=false``: not recorded). A resumed run first cuts the file back to the checkpoint's step,
as ``metrics.jsonl`` is cut (rows after it are dropped; a torn last line too). The format is
:mod:`strategies.tracing.trace`'s; its keys are :data:`experiments.schema.TRACE_FIELDS`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from experiments import schema
from experiments.app import records
from strategies.tracing import FORMATS, Format, Trace, TraceError, TraceRecorder

__all__ = ["TraceFile", "start", "trace_format"]


def trace_format(precision: Any) -> Format:
    """The activation-gradient format of a precision mode (its ``max`` and ``smallest_normal``;
    the smallest subnormal from :data:`strategies.tracing.FORMATS`)."""
    known = FORMATS.get(precision.name)
    sub = known.smallest_subnormal if known is not None else precision.smallest_normal * 2.0**-10
    saturates = known.saturates if known is not None else False
    return Format(precision.name, float(precision.max), float(precision.smallest_normal), sub, saturates)


class TraceFile:
    """``trace.jsonl`` of one run directory, fed by a :class:`TraceRecorder` (module docstring)."""

    def __init__(self, path: Path, strategy: Any, model: torch.nn.Module, precision: Any, meta: dict[str, Any],
                 act: bool = True) -> None:
        self.path = path
        self.recorder = TraceRecorder(strategy, model, format=trace_format(precision), meta=meta,
                                      forward=getattr(precision, "autocast", None) if act else None)
        self._fh: Any = None

    def open(self, start_step: int) -> None:
        """Start the file (header), or cut a resumed run's file back to ``start_step``."""
        if start_step > 0 and self.path.exists():
            try:
                kept = Trace.from_lines(self.path.read_text().splitlines()).truncated(start_step)
                records.write_text_atomic(self.path, "".join(line + "\n" for line in kept.lines()))
            except (TraceError, OSError, UnicodeDecodeError):  # unreadable: start over (the metrics stay)
                self.path.unlink(missing_ok=True)
        if not self.path.exists() or start_step == 0:
            records.write_text_atomic(self.path, json.dumps(self.recorder.header()) + "\n")
        self._fh = open(self.path, "a", encoding="utf-8")

    def flush(self, step: int, hist: dict | None = None) -> None:
        """Write the rows recorded since the last flush (one host read), with the histogram of
        train line ``step`` when it has one."""
        if hist is not None:
            self.recorder.histogram(step, hist["lo"], hist["counts"], hist.get("zeros", 0))
        chunk = self.recorder.flush()
        if chunk is not None and self._fh is not None:
            self._fh.write(json.dumps(chunk) + "\n")
            self._fh.flush()

    def close(self) -> None:
        self.recorder.remove()
        if self._fh is not None:
            self._fh.close()
            self._fh = None



def start(rec: Any, parts: Any, run_cfg: Any, names: dict[str, str]) -> TraceRecorder | None:
    """Open the run's trace (rank 0, ``train.trace``) as ``rec.trace``; return the recorder the step
    feeds (None: no trace)."""
    if not (rec.main and run_cfg.train.trace):
        return None
    t = run_cfg.train
    meta = {**names, "seed": run_cfg.seed, "steps": t.steps, "log_every": t.log_every, "hist_every": t.hist_every}
    rec.trace = TraceFile(rec.rundir.path / schema.TRACE_NAME, parts.strategy, parts.raw_model, parts.precision, meta,
                          act=t.trace_act)
    rec.trace.open(rec.start_step)
    return rec.trace.recorder
