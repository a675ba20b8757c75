"""One untrusted run record read into typed values: JSON parsed with a bound on integers, every
value coerced through :mod:`experiments.schema` and counted when it has the wrong type, strings
cut, and the run's status after loading (:func:`classify`).

Bounds: strings longer than :data:`MAX_TEXT` characters are cut (``… [N chars]``); an integer in
a record beyond float range (``|x| >= 2**1024``, or more digits than Python parses) is read by
:func:`parse_json` as :data:`OUT_OF_RANGE` and counted as a bad value like a wrong type.

Statuses after loading: ``completed``, ``diverged``, ``failed``, ``incomplete`` (no summary, or
still ``running``, or ``requeued`` by SLURM: pending), or any other status word a writer used
(e.g. ``stalled``), kept as written; only ``completed`` runs enter the statistics.

:class:`analysis.runset.Builder` puts these values into the tables of a run set.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from typing import Any, Iterable, Mapping

from experiments.schema import KIND_EVAL, KIND_FIDELITY, KIND_TRAIN, TRAIN_FIELDS, Field, coerce

__all__ = ["MAX_NAME", "MAX_TEXT", "OUT_OF_RANGE", "OutOfRange", "STATUSES", "as_float", "cell",
           "classify", "coerce_fields", "cut", "describe_bad", "finite_mean", "line_problem",
           "parse_json", "segments_note", "workload_of"]

#: Statuses every report table shows (others a writer used are appended after them).
STATUSES = ("completed", "diverged", "failed", "incomplete")

_STATUS_WORD = re.compile(r"[a-z][a-z_]{0,23}")

#: Longest string kept from a record (strategy, error, …); longer ones are cut.
MAX_TEXT = 1000
#: Longest layer or scale-group name kept (they label figure axes).
MAX_NAME = 100


class OutOfRange:
    """A JSON integer no float can hold: what :func:`parse_json` reads in its place (it is not a
    number to :func:`experiments.schema.coerce`, so it becomes ``None`` and is counted)."""

    def __repr__(self) -> str:
        return "<integer beyond float range>"


OUT_OF_RANGE = OutOfRange()
_HUGE = " (beyond float range)"  # marks such a key in the counters of coerce_fields


def _parse_int(text: str) -> int | OutOfRange:
    if len(text) > 320:  # more digits than any float (and than Python's 4300-digit limit)
        return OUT_OF_RANGE
    value = int(text)
    return value if abs(value) <= sys.float_info.max else OUT_OF_RANGE


def parse_json(data: bytes | str) -> Any:
    """``json.loads`` of untrusted record text: bytes that are not UTF-8 are replaced, an
    integer beyond float range becomes :data:`OUT_OF_RANGE`; ``NaN``/``Infinity`` are kept (a
    diverged loss). Raises ``ValueError`` (``json.JSONDecodeError``) or ``RecursionError``."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    return json.loads(data, parse_int=_parse_int)


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text)} chars]"


def coerce_fields(fields: Mapping[str, Field], raw: Mapping[str, Any], bad: Counter
                  ) -> dict[str, Any]:
    """``raw``'s known keys coerced through the schema; every value that was present but had
    the wrong type (or a map entry that was not a number) is counted in ``bad`` by key."""
    out: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        value = raw[name]
        out[name] = coerce(f, value)
        if isinstance(value, OutOfRange):
            bad[name + _HUGE] += 1
        elif value is not None and out[name] is None:
            bad[name] += 1
        elif isinstance(out[name], str):
            out[name] = cut(out[name])
        elif f.type == "float_map" and isinstance(value, Mapping) and len(out[name]) < len(value):
            bad[name] += 1
    return out


def describe_bad(where: str, bad: Counter) -> str:
    """``"summary.json: wrong type for seed, strategy (ignored)"`` — one line for a record
    (``integer beyond float range for …`` for the keys :func:`coerce_fields` marked so)."""
    def keys(items: list[tuple[str, int]]) -> str:
        return ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in sorted(items))

    huge = [(k.removesuffix(_HUGE), n) for k, n in bad.items() if k.endswith(_HUGE)]
    wrong = [(k, n) for k, n in bad.items() if not k.endswith(_HUGE)]
    parts = ([f"wrong type for {keys(wrong)}"] if wrong else []) + \
        ([f"integer beyond float range for {keys(huge)}"] if huge else [])
    return f"{where}: {'; '.join(parts)} (ignored)"


def segments_note(segments: Any) -> str | None:
    """One line when a run's ``segments`` (``summary.json``) ran on more than one commit or torch
    version — ``resumed on other code: from step 0 git 0123abcd… torch 2.13.0; from step 20 git …``
    — else ``None`` (entries that are not objects, and values that are not strings, are ignored)."""
    if not isinstance(segments, list):
        return None
    seen = []
    for seg in segments[:50]:
        if not isinstance(seg, Mapping):
            continue
        sha, tv = (seg.get(k) if isinstance(seg.get(k), str) else None for k in ("git_sha", "torch_version"))
        start = coerce(TRAIN_FIELDS["step"], seg.get("start_step"))
        seen.append((start, (sha or "?")[:12], (tv or "?")[:40]))
    if len({(sha, tv) for _, sha, tv in seen}) < 2:
        return None
    return "resumed on other code: " + "; ".join(
        f"from step {'?' if s is None else s} git {sha} torch {tv}" for s, sha, tv in seen[:6])


def line_problem(obj: Any) -> str | None:
    """Why a parsed ``metrics.jsonl`` line cannot be used (``None`` when it can): it must be an
    object with a known ``kind`` and an integral ``step``."""
    if not isinstance(obj, Mapping):
        return f"not a JSON object ({type(obj).__name__})"
    if obj.get("kind") not in (KIND_TRAIN, KIND_EVAL, KIND_FIDELITY):
        return "no known kind (train, eval, fidelity)"
    if coerce(TRAIN_FIELDS["step"], obj.get("step")) is None:
        return "step is not an integer"
    return None


def classify(summary: Mapping[str, Any] | None) -> str:
    """The run's status after loading (see the module docstring)."""
    if summary is None:
        return "incomplete"
    status = summary.get("status")
    if status == "diverged" or summary.get("diverged") is True:
        return "diverged"
    if status in (None, "running", "requeued"):  # requeued: the job runs again (pending, not failed)
        return "incomplete"
    return status if _STATUS_WORD.fullmatch(status) else "unknown"


def workload_of(rec: Mapping[str, Any]) -> str | None:
    """The run's workload: as recorded, else ``model/data/regime`` (regime ``plain`` when
    absent), else ``None`` when model or data is unknown."""
    if rec.get("workload"):
        return str(rec["workload"])
    parts = [rec.get("model"), rec.get("data"), rec.get("regime") or "plain"]
    if parts[0] is None or parts[1] is None:
        return None
    return "/".join(str(p) for p in parts)


_FLOAT = Field("value", float, "a number")


def as_float(x: Any) -> float | None:
    """A number as float (NaN/inf kept); anything else (a bool too) as ``None``."""
    return coerce(_FLOAT, x)


def cell(x: Any) -> float | bool | None:
    """A coerced scalar for a table cell: bools stay bools, numbers become floats."""
    return x if x is None or isinstance(x, bool) else float(x)


def finite_mean(xs: Iterable[float]) -> float | None:
    """The mean of the finite values of ``xs`` (``math.fsum``); ``None`` when there is none."""
    finite = [x for x in xs if math.isfinite(x)]
    return math.fsum(finite) / len(finite) if finite else None
