"""``scalelab-replay SWEEP_DIR --table``: for each failed or stalled run under a directory, what every
preset would have done on its trace, written into the run directory as ``replay.json``
(``experiments.schema.REPLAY_FIELDS``) for the report's replay table (``analysis``, which reads
run records only through the schema: the replay is computed here, on the experiments side).

A run counts as failed or stalled (:func:`failure`) when its summary says ``diverged``, ``stalled``
or ``failed``, when the scale it ran at reached its strategy's ``min_scale`` (read from the run's
``.hydra/config.yaml``), or when it skipped at least :data:`SKIP_SHARE` of its steps. Healthy runs
get no file (an older ``replay.json`` of a run now healthy is removed, so the table never shows a
stale row). Each preset is replayed with :func:`strategies.tracing.replay` under the run's precision;
a preset whose input the trace lacks (``norm_ratio`` and ``hybrid``: the fp32 probe) gets its
reason instead of numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import yaml

from experiments import schema
from experiments.app.train import group_options
from experiments.replay import presets
from experiments.replay.tracefile import ReplayError, load_trace
from strategies.tracing import Trace
from strategies.tracing.inputs import MissingInput
from strategies.tracing.replay import ReplayResult, replay

__all__ = ["SKIP_SHARE", "failure", "precision_of", "preset_row", "replay_run", "write_tables"]

SKIP_SHARE = 0.10
"""A run that skipped at least this share of its steps counts as failed (the issue's threshold)."""

_FAILED = ("diverged", "stalled", "failed")


def _recorded_floor(run_dir: Path) -> float | None:
    """The run's ``strategy.min_scale`` from ``.hydra/config.yaml`` (None: absent or unreadable)."""
    try:
        cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
        value = cfg["strategy"]["min_scale"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def failure(status: str | None, trace: Trace, floor: float | None) -> str | None:
    """Why the recorded run counts as failed or stalled (one line), or None when it is healthy:
    its status, its scale at ``floor`` (the strategy's ``min_scale``) or skips >= :data:`SKIP_SHARE`."""
    reasons = []
    if status in _FAILED:
        reasons.append(status)
    if floor is not None and trace.scale:
        at_floor = sum(1 for row in trace.scale if min(row) <= floor)
        if at_floor:
            reasons.append(f"at its min scale {floor:g} for {at_floor} of {len(trace)} steps")
    skipped = sum(trace.found_inf)
    if len(trace) and skipped / len(trace) >= SKIP_SHARE:
        reasons.append(f"skipped {skipped} of {len(trace)} steps ({100 * skipped / len(trace):.0f}%)")
    return "; ".join(reasons) or None


def _row(name: str, result: ReplayResult) -> dict[str, Any]:
    s = result.summary()
    floor = s["floor"]
    return {"strategy": name, "steps": s["steps"], "skipped": s["skipped"], "min_scale": s["min_scale"],
            "min_scale_step": s["min_scale_step"], "floor": floor,
            "floor_steps": 0 if floor is None else sum(1 for x in result.steps if x.scale <= floor),
            "final_scale": s["final_scale"], "stopped": s["stopped"]}


def precision_of(trace: Trace) -> str:
    """The ``precision`` option a preset is built under for ``trace``: its format's, else fp16."""
    return trace.format.name if trace.format.name in group_options("precision") else "fp16"


def preset_row(trace: Trace, name: str, overflow: str = "auto") -> dict[str, Any]:
    """One ``REPLAY_ROW_FIELDS`` row: ``name`` (a ``conf/strategy`` option) replayed on ``trace``
    under the trace's precision, or the reason it cannot be (``unreplayable``)."""
    strategy = presets.build(name, precision_of(trace))
    try:
        return _row(name, replay(trace, strategy, overflow=overflow))
    except MissingInput as exc:
        return {"strategy": name, "unreplayable": str(exc)}


def replay_run(run_dir: Path, names: list[str], overflow: str = "auto") -> dict[str, Any] | None:
    """The ``replay.json`` object of a failed or stalled run (``REPLAY_FIELDS``), None for a healthy one.
    Raises :class:`ReplayError` when the run has no readable trace."""
    try:
        summary = json.loads((run_dir / schema.SUMMARY_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    status = schema.coerce(schema.SUMMARY_FIELDS["status"], summary.get("status")) if isinstance(summary, dict) else None
    trace = load_trace(run_dir)
    why = failure(status, trace, _recorded_floor(run_dir))
    if why is None:
        return None
    last = trace.scale[-1][-1]
    return {"why": why, "recorded": str(trace.meta.get("strategy", "?")), "precision": trace.format.name,
            "steps": len(trace), "skipped": sum(trace.found_inf), "final_scale": last if math.isfinite(last) else None,
            "overflow": overflow, "presets": [preset_row(trace, n, overflow) for n in names]}


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob(schema.TRACE_NAME) if (p.parent / schema.SUMMARY_NAME).is_file())


def write_tables(root: Path, names: list[str] | None = None, overflow: str = "auto",
                 say: Callable[[str], None] = print) -> list[Path]:
    """Write ``replay.json`` into every failed or stalled run under ``root`` (module docstring) and
    return their paths; ``say`` gets one line per run written or skipped."""
    if not root.is_dir():
        raise ReplayError(f"{root} is not a directory")
    names = names or presets.options()
    written = []
    for run_dir in _run_dirs(root):
        out = run_dir / schema.REPLAY_NAME
        try:
            obj = replay_run(run_dir, names, overflow)
        except ReplayError as exc:
            say(f"{run_dir}: not replayed: {exc}")
            continue
        if obj is None:
            out.unlink(missing_ok=True)
            continue
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
        tmp.replace(out)
        written.append(out)
        say(f"{out}: {obj['why']}: {len(names)} presets replayed")
    return written
