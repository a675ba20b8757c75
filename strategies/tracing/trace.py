"""The statistics trace: per step, what any rule reads, in a plain object and a compact file format.

A :class:`Trace` holds, for steps ``1..n`` of one run (or any loop), plain Python values:

* ``found_inf`` — the step's gradients were non-finite (the step was skipped);
* ``loss`` — the training loss (non-finite: the forward itself overflowed, or the data held a NaN);
* ``grad_absmax``, ``grad_sumsq`` — abs-max and sum of squares of the *unscaled* parameter
  gradients (the statistics a rule's ``update_`` reads: :class:`strategies.stats.GradStats`);
* ``zero_frac``, ``subnormal_frac`` — the fractions of parameter-gradient entries that arrived
  exactly zero / nonzero below 2^-14 (scaled, as the statistics pass counts them; NaN if unknown);
* ``lr`` — the learning rate; ``scale`` — the scale(s) the step ran at (one per group of the
  recording strategy: ``scale_groups``);
* ``group_absmax`` — abs-max of the unscaled parameter gradients per *layer group* (``groups``:
  the default groups of ``layerwise``, :func:`strategies.layer_groups.resolve`), what per-layer
  rules read;
* ``act_absmax``, ``act_module`` — the abs-max of the step's low-precision forward activations (finite entries)
  (every leaf module's output: :mod:`strategies.tracing.activations`) and the index, in
  ``act_modules``, of the module holding it (NaN and -1 when not recorded); ``act_max`` is the
  forward format's largest finite value (65504 for fp16; NaN: not recorded), so that
  ``log2(act_max / act_absmax)`` is the forward's headroom in binades;
* ``histograms`` — at the steps it was measured (sparse: e.g. every ``hist_every`` steps), the
  exponent histogram ``floor(log2|g|)`` of the activation gradients at the layer boundaries, as
  they flowed in backward (scaled by the step's scale), summed over layers.

File format (JSON lines, appended at the logging interval; a killed run keeps every full line):
a header ``{"kind": "trace_header", "version", "groups", "group_numel", "scale_groups", "format",
"meta", "act_modules", "act_max"}``, then chunks ``{"kind": "trace", "step": first step, "n": rows, "data": base64 of the
rows as little-endian float32, "hist": [{"step", "lo", "counts", "zeros"}]}``. A row is
:func:`columns` wide: the seven per-step columns, the scale(s), the group abs-maxes, then
``act_absmax`` and ``act_module`` (version 2; a version-1 trace, without them, reads as NaN and
-1). Standard library only (a reader needs no torch).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

__all__ = [
    "ACT_COLUMNS", "BASE_COLUMNS", "FORMATS", "Format", "Histogram", "KIND_CHUNK", "KIND_HEADER", "Trace", "TraceError",
    "VERSION", "columns", "decode_rows", "encode_chunk", "header_line",
]

VERSION = 2
READS = (1, 2)
"""The versions this reader reads (1: rows without the activation columns)."""
KIND_HEADER, KIND_CHUNK = "trace_header", "trace"
BASE_COLUMNS = ("found_inf", "loss", "grad_absmax", "grad_sumsq", "zero_frac", "subnormal_frac", "lr")
ACT_COLUMNS = ("act_absmax", "act_module")
"""The last two columns of a row (version 2): the forward activation abs-max and its module's index."""


class TraceError(ValueError):
    """A trace that cannot be read (the message is one line)."""


@dataclass(frozen=True)
class Format:
    """The number format the activation gradients live in: ``max`` (overflow beyond it),
    ``smallest_normal`` and ``smallest_subnormal`` (entries below half of it flush to zero);
    ``saturates``: values past ``max`` are clipped, never infinite (fp8 e4m3)."""

    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    saturates: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max": self.max, "smallest_normal": self.smallest_normal,
                "smallest_subnormal": self.smallest_subnormal, "saturates": self.saturates}


FORMATS = {
    "fp16": Format("fp16", 65504.0, 2.0**-14, 2.0**-24),
    "bf16": Format("bf16", 3.3895313892515355e38, 2.0**-126, 2.0**-133),
    "fp32": Format("fp32", 3.4028234663852886e38, 2.0**-126, 2.0**-149),
    "fp8_e5m2": Format("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16),
    "fp8_hybrid": Format("fp8_hybrid", 57344.0, 2.0**-14, 2.0**-16),
    "fp8_e4m3": Format("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, saturates=True),
}
"""The precision modes' activation-gradient formats (``experiments/workloads/precision.py``)."""


@dataclass(frozen=True)
class Histogram:
    """``counts[i]`` entries with ``floor(log2|g|) == lo + i`` (the first and last bins also hold
    everything below / above), ``zeros`` exact zeros."""

    lo: int
    counts: list[int]
    zeros: int = 0


def columns(num_scales: int, num_groups: int) -> list[str]:
    """The names of a row's columns."""
    return [*BASE_COLUMNS, *(f"scale.{i}" for i in range(num_scales)), *(f"group_absmax.{i}" for i in range(num_groups)),
            *ACT_COLUMNS]


@dataclass
class Trace:
    """A run's statistics trace (module docstring); every list has one entry per step."""

    groups: list[str]
    group_numel: list[int]
    scale_groups: list[str] = field(default_factory=lambda: ["all"])
    format: Format = FORMATS["fp16"]
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    found_inf: list[bool] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_absmax: list[float] = field(default_factory=list)
    grad_sumsq: list[float] = field(default_factory=list)
    zero_frac: list[float] = field(default_factory=list)
    subnormal_frac: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    scale: list[list[float]] = field(default_factory=list)
    group_absmax: list[list[float]] = field(default_factory=list)
    histograms: dict[int, Histogram] = field(default_factory=dict)
    act_absmax: list[float] = field(default_factory=list)
    act_module: list[int] = field(default_factory=list)
    act_modules: list[str] = field(default_factory=list)
    act_max: float = math.nan

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def numel(self) -> int:
        return sum(self.group_numel)

    def add_row(self, step: int, row: list[float]) -> None:
        """Append step ``step`` from one row of :func:`columns` (or of version 1's, without the
        activation columns: NaN and -1)."""
        b, s, g = len(BASE_COLUMNS), len(self.scale_groups), len(self.groups)
        found, loss, absmax, sumsq, zf, sf, lr = row[:b]
        self.steps.append(step)
        self.found_inf.append(found != 0)
        for name, v in zip(BASE_COLUMNS[1:], (loss, absmax, sumsq, zf, sf, lr)):
            getattr(self, name).append(v)
        self.scale.append(list(row[b:b + s]))
        self.group_absmax.append(list(row[b + s:b + s + g]))
        act, module = row[b + s + g:] if len(row) == b + s + g + len(ACT_COLUMNS) else (math.nan, -1.0)
        self.act_absmax.append(act)
        self.act_module.append(int(module) if math.isfinite(module) else -1)

    def act_name(self, j: int) -> str | None:
        """The name of the module holding row ``j``'s activation abs-max (None: not recorded)."""
        k = self.act_module[j]
        return self.act_modules[k] if 0 <= k < len(self.act_modules) else None

    def truncated(self, step: int) -> "Trace":
        """The steps up to ``step`` only."""
        n = sum(1 for s in self.steps if s <= step)
        out = Trace(self.groups, self.group_numel, self.scale_groups, self.format, dict(self.meta),
                    act_modules=list(self.act_modules), act_max=self.act_max)
        for name in ("steps", "found_inf", "loss", "grad_absmax", "grad_sumsq", "zero_frac", "subnormal_frac", "lr",
                     "scale", "group_absmax", "act_absmax", "act_module"):
            setattr(out, name, getattr(self, name)[:n])
        out.histograms = {k: h for k, h in self.histograms.items() if k <= step}
        return out

    # ------------------------------------------------------------------ the file format
    def header(self) -> dict[str, Any]:
        return header_line(self.groups, self.group_numel, self.scale_groups, self.format, self.meta,
                           self.act_modules, self.act_max)

    def lines(self, chunk: int = 1000) -> Iterator[str]:
        """The trace as JSON lines (header, then chunks of ``chunk`` rows)."""
        yield json.dumps(self.header())
        for i in range(0, len(self.steps), chunk):
            rows = [self._row(j) for j in range(i, min(i + chunk, len(self.steps)))]
            hist = {k: h for k, h in self.histograms.items() if self.steps[i] <= k <= self.steps[i + len(rows) - 1]}
            yield json.dumps(encode_chunk(self.steps[i], rows, hist))

    def _row(self, j: int) -> list[float]:
        return [float(self.found_inf[j]), self.loss[j], self.grad_absmax[j], self.grad_sumsq[j], self.zero_frac[j],
                self.subnormal_frac[j], self.lr[j], *self.scale[j], *self.group_absmax[j], self.act_absmax[j],
                float(self.act_module[j])]

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> "Trace":
        """Read a trace file's lines; a malformed *last* line (a killed writer) is dropped, any
        other malformed line raises :class:`TraceError`."""
        items = list(lines)
        trace: Trace | None = None
        for i, text in enumerate(items):
            try:
                obj = json.loads(text)
            except ValueError as exc:
                if i == len(items) - 1 and trace is not None:
                    break  # the line a killed writer left half-written
                raise TraceError(f"line {i + 1}: not JSON: {exc}"[:300]) from None
            try:
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
                trace = _apply(trace, obj)
            except (ValueError, KeyError, TypeError, struct.error) as exc:
                raise TraceError(f"line {i + 1}: {type(exc).__name__}: {exc}"[:300]) from None
        if trace is None:
            raise TraceError("no trace header")
        return trace


def header_line(groups: list[str], group_numel: list[int], scale_groups: list[str], fmt: Format,
                meta: dict[str, Any], act_modules: list[str] | None = None, act_max: float = math.nan) -> dict[str, Any]:
    """The header line (``act_max`` NaN: written as null, no activations recorded)."""
    return {"kind": KIND_HEADER, "version": VERSION, "groups": list(groups), "group_numel": list(group_numel),
            "scale_groups": list(scale_groups), "format": fmt.as_dict(), "meta": dict(meta),
            "act_modules": list(act_modules or []), "act_max": act_max if math.isfinite(act_max) else None}


def encode_chunk(first_step: int, rows: list[list[float]], hist: dict[int, Histogram] | None = None) -> dict[str, Any]:
    """One chunk line: rows of steps ``first_step ..`` as base64 float32, and their histograms."""
    width = len(rows[0]) if rows else 0
    flat = [float(x) for r in rows for x in r]
    data = base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode("ascii")
    out: dict[str, Any] = {"kind": KIND_CHUNK, "step": int(first_step), "n": len(rows), "width": width, "data": data}
    if hist:
        out["hist"] = [{"step": k, "lo": h.lo, "counts": list(h.counts), "zeros": h.zeros} for k, h in sorted(hist.items())]
    return out


def decode_rows(chunk: dict[str, Any]) -> list[list[float]]:
    """The rows of a chunk line."""
    n, width = int(chunk["n"]), int(chunk["width"])
    raw = base64.b64decode(chunk["data"], validate=True)
    if len(raw) != 4 * n * width:
        raise ValueError(f"chunk at step {chunk.get('step')}: {len(raw)} bytes for {n} rows of {width}")
    flat = struct.unpack(f"<{n * width}f", raw)
    return [list(flat[i * width:(i + 1) * width]) for i in range(n)]


def _format(obj: Any) -> Format:
    if not isinstance(obj, dict):
        raise ValueError("format must be an object")
    return Format(str(obj["name"]), float(obj["max"]), float(obj["smallest_normal"]),
                  float(obj["smallest_subnormal"]), bool(obj.get("saturates", False)))


def _apply(trace: Trace | None, obj: dict[str, Any]) -> Trace:
    """Fold one line into the trace being read."""
    kind = obj.get("kind")
    if kind == KIND_HEADER:
        if obj.get("version") not in READS:
            raise ValueError(f"trace version {obj.get('version')!r}, this reader knows {', '.join(map(str, READS))}")
        groups, numel = [str(g) for g in obj["groups"]], [int(n) for n in obj["group_numel"]]
        if len(groups) != len(numel) or not groups:
            raise ValueError("groups and group_numel must have the same, nonzero length")
        if trace is not None:  # a resumed run writes its header again: it must be the same run's
            if groups != trace.groups:
                raise ValueError(f"a second header with other groups {groups}")
            return trace
        act_max = obj.get("act_max")
        return Trace(groups, numel, [str(g) for g in obj["scale_groups"]], _format(obj["format"]), dict(obj.get("meta") or {}),
                     act_modules=[str(n) for n in obj.get("act_modules") or []],
                     act_max=float(act_max) if act_max is not None else math.nan)
    if kind != KIND_CHUNK:
        raise ValueError(f"unknown line kind {kind!r}")
    if trace is None:
        raise ValueError("a chunk before the header")
    rows = decode_rows(obj)
    width = len(columns(len(trace.scale_groups), len(trace.groups)))
    if rows and len(rows[0]) not in (width, width - len(ACT_COLUMNS)):
        raise ValueError(f"rows of width {len(rows[0])}, the header says {width}")
    first = int(obj["step"])
    if trace.steps and first <= trace.steps[-1]:
        raise ValueError(f"chunk at step {first} after step {trace.steps[-1]}")
    for i, row in enumerate(rows):
        trace.add_row(first + i, row)
    for h in obj.get("hist") or []:
        trace.histograms[int(h["step"])] = Histogram(int(h["lo"]), [int(c) for c in h["counts"]], int(h.get("zeros", 0)))
    return trace
