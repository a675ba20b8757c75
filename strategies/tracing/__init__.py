"""Statistics traces and their replay: what a run's rule read, per step, and what another rule
would have done with it (``strategies.replay``).

* :mod:`strategies.tracing.trace` — the :class:`Trace` (plain values) and its file format;
* :mod:`strategies.tracing.recorder` — :class:`TraceRecorder`, recording one in any loop (device
  buffer, one read per flush);
* :mod:`strategies.tracing.replay` — :func:`replay`, a strategy run on a trace through its own
  ``update()``; :mod:`strategies.tracing.inputs` — what it is fed (the overflow model).
"""

from __future__ import annotations

from strategies.tracing.recorder import TraceRecorder
from strategies.tracing.inputs import MissingInput
from strategies.tracing.replay import ReplayResult, ReplayStep, replay
from strategies.tracing.trace import FORMATS, Format, Histogram, Trace, TraceError

__all__ = ["FORMATS", "Format", "Histogram", "MissingInput", "ReplayResult", "ReplayStep", "Trace", "TraceError",
           "TraceRecorder", "replay"]
