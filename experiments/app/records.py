"""Run records (``metrics.jsonl``, ``summary.json``), written through ``experiments/schema.py``.

Every line and every summary is checked against the schema before it is written: a key the
schema does not know is a programming error (``KeyError``), so file names, line kinds and keys
are spelled in one place. ``metrics.jsonl`` is appended and flushed line by line, so a killed run
keeps what it wrote; on resume it is truncated back to the checkpoint's step
(:func:`truncate_metrics`), keeping every valid line up to it and dropping malformed ones, so the
record has no duplicate steps and a bad line never blocks a resume. ``summary.json`` is written
atomically (``running`` at start, the final one at the end); its numbers are computed from
``metrics.jsonl`` itself plus the loop's host counters, so a resumed run summarises its whole
history. Nothing secret (API keys, tokens) is ever written to a record.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from experiments import schema

__all__ = [
    "GIT_SAFE",
    "MetricsWriter",
    "check",
    "read_json",
    "write_summary",
    "read_metrics",
    "truncate_metrics",
    "write_json_atomic",
    "write_text_atomic",
    "summarize",
    "fingerprint",
    "redact",
    "segments",
]

_LINE_FIELDS = {schema.KIND_TRAIN: schema.TRAIN_FIELDS, schema.KIND_EVAL: schema.EVAL_FIELDS,
                schema.KIND_FIDELITY: schema.FIDELITY_FIELDS}
_SECRET = re.compile(r"(api[_-]?key|token|secret|password|passwd)", re.IGNORECASE)
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _clean(value: Any) -> Any:
    """Tensors to lists, tuples to lists, keys to str. Non-finite floats stay as they are and are
    written as ``NaN``/``Infinity`` (accepted by Python's ``json`` and by pandas)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def check(fields: dict[str, schema.Field], record: dict) -> dict:
    """``record`` if every key is a field of ``fields`` and every required field is present."""
    unknown = [k for k in record if k not in fields]
    missing = [f.name for f in fields.values() if not f.optional and f.name not in record]
    if unknown or missing:
        raise KeyError(f"record does not follow the schema: unknown keys {unknown}, missing {missing}")
    return record


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` via a temporary file and ``os.replace``, creating its
    folder: a reader never sees half a page, and a failed write leaves the old one. The one way the
    app writes a file others read (run records, ``docs/doctor.md``, the bench pages)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")


def write_summary(path: str | Path, summary: dict) -> None:
    """``summary.json``, checked against ``schema.SUMMARY_FIELDS``, written atomically."""
    write_json_atomic(path, check(schema.SUMMARY_FIELDS, summary))


def read_json(path: str | Path) -> dict:
    """A JSON object file as a dict (``{}`` when it does not exist, is unreadable or not an object)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _valid_line(line: str) -> dict | None:
    """A ``metrics.jsonl`` line as a dict when it is a JSON object of a known kind with an integer step."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("kind"), str) or row["kind"] not in _LINE_FIELDS:
        return None
    step = row.get("step")
    return row if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def read_metrics(path: str | Path) -> list[dict]:
    """The valid lines of a ``metrics.jsonl`` (torn or malformed lines are left out)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = (_valid_line(line) for line in path.read_text(errors="replace").splitlines())
    return [r for r in rows if r is not None]


def truncate_metrics(path: str | Path, step: int) -> tuple[int, int]:
    """Keep the valid lines with ``step <= step`` (atomic rewrite, lines kept byte for byte).

    Returns ``(later, malformed)``: how many valid lines after ``step`` and how many malformed
    lines (not JSON, not an object, unknown kind, non-integer step) were dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0, 0
    kept, later, malformed = [], 0, 0
    for line in path.read_text(errors="replace").splitlines():
        row = _valid_line(line)
        if row is None:
            malformed += int(bool(line.strip()))
        elif row["step"] > step:
            later += 1
        else:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))
    return later, malformed


class MetricsWriter:
    """Append-and-flush writer of ``metrics.jsonl`` lines (a no-op on non-main ranks)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._f = open(self.path, "a") if self.path is not None else None

    def write(self, row: dict) -> None:
        check(_LINE_FIELDS[row["kind"]], row)
        if self._f is not None:
            self._f.write(json.dumps(_clean(row)) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def redact(obj: Any) -> Any:
    """Copy of a config/override structure with secret-looking keys' values replaced by ``***``."""
    if isinstance(obj, dict):
        return {k: ("***" if _SECRET.search(str(k)) else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str) and "=" in obj and _SECRET.search(obj.split("=", 1)[0]):
        return obj.split("=", 1)[0] + "=***"
    return obj


GIT_SAFE = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "--no-optional-locks")
"""Options of every fingerprint ``git`` call: no file-system monitor program, no hooks, no index
write (``--no-optional-locks``), so reading the SHA and dirtiness runs no program but git."""


def _git(*args: str) -> str | None:
    """``git ARGS`` in this code's checkout, with :data:`GIT_SAFE` and without the caller's
    ``GIT_*`` variables (``GIT_DIR``, ``GIT_CONFIG_*``, ``GIT_EXEC_PATH``, ... would choose
    another repository, configuration or program); ``None`` when git is missing or fails."""
    if not (_REPO_ROOT / ".git").exists():
        return None  # an installed copy (site-packages): any repository around it is not this code's
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        out = subprocess.run(
            ["git", *GIT_SAFE, *args], cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def fingerprint(config: dict, overrides: list[str], device: str) -> dict:
    """Where this run came from: git SHA and dirtiness, the resolved config, overrides, versions."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_sha": sha,
        "git_dirty": bool(status) if status is not None else None,
        "config": redact(config),
        "overrides": redact(list(overrides)),
        "torch_version": str(torch.__version__),  # a str, not TorchVersion: checkpoints load weights_only
        "device": device,
        "hostname": socket.gethostname(),
    }


def segments(state: dict | None, fingerprint: dict, steps: int, summary: dict | None = None) -> list[dict]:
    """The run's segments (``summary.json``'s ``segments``, :data:`experiments.schema.SEGMENT_KEYS`):
    those the checkpoint ``state`` recorded (so a process whose steps were dropped on resume is left
    out), then this process's: from the checkpoint's step (0 without one), with its ``train.steps``
    and the versions and host of ``fingerprint``.

    A checkpoint written before segments were recorded gives one first segment from step 0, with the
    ``train.steps`` of its config and the versions of the previous ``summary``'s fingerprint (the last
    process that wrote it; ``None`` where there is none)."""
    def entry(start: int, steps_: Any, fp: dict) -> dict:
        return {"start_step": start, "steps": steps_, **{k: fp.get(k) for k in schema.SEGMENT_KEYS[2:]}}

    if state is None:
        return [entry(0, steps, fingerprint)]
    this = entry(int(state["step"]), steps, fingerprint)
    earlier = state.get("segments")
    if isinstance(earlier, list) and all(isinstance(seg, dict) for seg in earlier):
        return [dict(seg) for seg in earlier] + [this]
    fp = (summary or {}).get("fingerprint")
    train = (state.get("config") or {}).get("train") if isinstance(state.get("config"), dict) else None
    first = entry(0, train.get("steps") if isinstance(train, dict) else None, fp if isinstance(fp, dict) else {})
    return [first, this]


def _finite_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize(rows: list[dict], counters: dict) -> dict:
    """The metric part of ``summary.json`` from the ``metrics.jsonl`` rows and host counters.

    ``counters``: ``steps``, ``skipped_steps``, ``timed_steps``, ``step_time_sum``,
    ``strategy_time_sum`` (sums over the steps after ``warmup``).
    """
    train = [schema.coerce_row(schema.TRAIN_FIELDS, r) for r in rows if r.get("kind") == schema.KIND_TRAIN]
    evals = [schema.coerce_row(schema.EVAL_FIELDS, r) for r in rows if r.get("kind") == schema.KIND_EVAL]
    evals = [e for e in evals if e.get("eval_loss") is not None]
    eval_losses = [e["eval_loss"] for e in evals if _finite_or_none(e.get("eval_loss")) is not None]
    n = counters.get("timed_steps", 0)
    mean_step = counters["step_time_sum"] / n if n else None
    overhead = counters["strategy_time_sum"] / n if n else None
    last_train = train[-1] if train else {}
    return {
        "steps": int(counters.get("steps", 0)),
        "final_train_loss": _finite_or_none(last_train.get("loss_avg", last_train.get("loss"))),
        "final_eval_loss": _finite_or_none(evals[-1]["eval_loss"]) if evals else None,
        "best_eval_loss": min(eval_losses) if eval_losses else None,
        "final_eval_metric": _finite_or_none(evals[-1].get("eval_metric")) if evals else None,
        **({"final_reward": _finite_or_none(evals[-1]["eval_reward"])}
           if evals and evals[-1].get("eval_reward") is not None else {}),
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "mean_step_time_s": mean_step,
        "strategy_overhead_s": overhead,
        "strategy_overhead_frac": (overhead / mean_step) if (overhead is not None and mean_step) else None,
        **_fidelity_means(rows, counters),
    }


def _fidelity_means(rows: list[dict], counters: dict) -> dict:
    """Means over the run's fidelity probes (skipped steps left out); empty when none ran."""
    probes = [schema.coerce_row(schema.FIDELITY_FIELDS, r) for r in rows if r.get("kind") == schema.KIND_FIDELITY]
    probes = [p for p in probes if not p.get("skipped")]
    if not probes:
        return {}

    def mean(values: list) -> float | None:
        finite = [v for v in values if _finite_or_none(v) is not None]
        return sum(finite) / len(finite) if finite else None

    return {
        "fidelity_one_minus_cos_mean": mean([None if p.get("cosine") is None else 1.0 - p["cosine"] for p in probes]),
        "fidelity_rel_err_mean": mean([p.get("rel_err") for p in probes]),
        "fidelity_lost_frac_mean": mean([p.get("lost_frac") for p in probes]),
        "fidelity_time_s": counters.get("fidelity_time_s"),
    }
