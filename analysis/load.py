"""Read scalelab run records (local sweep directories) into tidy pandas DataFrames.

A run record (see ``docs/run-records.md``; file names and keys from :mod:`experiments.schema`) is
a directory holding ``summary.json`` and ``metrics.jsonl`` next to Hydra's ``.hydra/``.
:func:`load_runs` searches one or more sweep directories recursively and returns a
:class:`~analysis.runset.RunSet` (tables described there).

Nothing is dropped silently and no record content can make loading fail: an unreadable or
non-object summary, a line that is not JSON, not an object, of no known kind or without an
integral step, a value of the wrong type, bytes that are not UTF-8 — each is skipped or set to
missing, and said in one line (:attr:`RunSet.problems` per file, the ``issues`` column per run).

:func:`load_wandb` (in :mod:`analysis.wandb_runs`) builds the same tables from the W&B API.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from experiments.schema import METRICS_NAME, SUMMARY_NAME

from analysis.runset import IDENTITY_KEYS, Builder, RunLoadError, RunSet, line_problem
from analysis.wandb_runs import load_wandb, wandb_rows_to_lines

__all__ = ["RunLoadError", "RunSet", "find_run_dirs", "iter_metrics", "load_runs", "load_wandb",
           "wandb_rows_to_lines"]

#: Most corrupt lines of one file listed one by one (the rest are counted in one line).
MAX_LINE_PROBLEMS = 5


def find_run_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """Every run directory under ``root`` (itself included), sorted.

    A run directory is one holding ``summary.json`` or ``metrics.jsonl``, or a Hydra job
    directory (``.hydra/`` present) that wrote neither — a job that died before logging, kept so
    that it is reported instead of vanishing.
    """
    root = Path(root)
    found: set[Path] = set()
    for name in (SUMMARY_NAME, METRICS_NAME):
        found.update(p.parent for p in root.rglob(name) if p.is_file())
    for hydra_dir in root.rglob(".hydra"):
        if hydra_dir.is_dir():
            found.add(hydra_dir.parent)
    return sorted(found)


def iter_metrics(path: str | os.PathLike[str], problems: list[str] | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Yield the usable JSON objects of a ``metrics.jsonl`` file, skipping corrupt lines.

    A line is corrupt when it is not valid JSON or :func:`analysis.runset.line_problem` rejects
    it; a truncated last line (a run killed mid-write) is the common case. Each one is described
    in ``problems`` as ``"<path>:<line>: <reason>"`` (the first few per file, then a count).
    Bytes that are not UTF-8 are replaced, never fatal.
    """
    path = Path(path)
    skipped = 0
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as exc:
                reason = f"corrupt line skipped ({getattr(exc, 'msg', 'nested too deep')})"
            else:
                why = line_problem(obj)
                if why is None:
                    yield obj
                    continue
                reason = f"line skipped ({why})"
            skipped += 1
            if problems is not None and skipped <= MAX_LINE_PROBLEMS:
                problems.append(f"{path}:{lineno}: {reason}")
    if problems is not None and skipped > MAX_LINE_PROBLEMS:
        problems.append(f"{path}: {skipped - MAX_LINE_PROBLEMS} more corrupt lines skipped")


def read_summary(run_dir: Path, problems: list[str]) -> dict[str, Any] | None:
    """The parsed ``summary.json`` of ``run_dir`` when it is a JSON object, else ``None`` (with
    the reason in ``problems``)."""
    path = run_dir / SUMMARY_NAME
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    except (json.JSONDecodeError, RecursionError, OSError) as exc:
        reason = "empty" if path.stat().st_size == 0 else f"{type(exc).__name__}: {exc}"
        problems.append(f"{path}: unreadable summary ({reason}); run labelled incomplete")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{path}: summary is a JSON {type(obj).__name__}, not an object; "
                        "run labelled incomplete")
        return None
    return obj


def hydra_identity(run_dir: Path) -> dict[str, Any]:
    """Best-effort identity of a run from ``.hydra/overrides.yaml`` (``key=value`` items for
    ``strategy``, ``precision``, ``model``, ``data``, ``regime``, ``seed``; a leading ``+``/``++``
    and a trailing ``.name`` are ignored); the builder coerces it like a summary."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    try:
        import yaml  # PyYAML ships with hydra-core/omegaconf

        overrides = yaml.safe_load(path.read_bytes().decode("utf-8", errors="replace")) or []
    except Exception:  # noqa: BLE001 - identity is best effort; the run is still listed
        return {}
    raw: dict[str, Any] = {}
    for item in overrides if isinstance(overrides, list) else []:
        if not isinstance(item, str) or "=" not in item:
            continue
        key, value = item.split("=", 1)
        key = key.lstrip("+").removesuffix(".name").split("/")[-1]
        if key == "seed":
            try:
                raw["seed"] = int(value)
            except ValueError:
                pass
        elif key in IDENTITY_KEYS:
            raw[key] = value
    return raw


def load_runs(paths: str | os.PathLike[str] | list[str | os.PathLike[str]]) -> RunSet:
    """Load every run under one or more (multi)run directories.

    ``run_id`` is the run directory relative to the sweep directory given, prefixed by that
    directory's name (``compare/3``), so runs of several sweeps stay distinct.

    Raises :class:`RunLoadError` when a path does not exist or holds no run record at all.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise RunLoadError("no run directory given")
    builder = Builder()
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise RunLoadError(f"run directory does not exist: {root}")
        if not root.is_dir():
            raise RunLoadError(f"not a directory: {root}")
        run_dirs = find_run_dirs(root)
        if not run_dirs:
            raise RunLoadError(f"no run records ({SUMMARY_NAME} / {METRICS_NAME}) under {root}")
        base = root.resolve()
        for run_dir in run_dirs:
            rel = run_dir.resolve().relative_to(base).as_posix()
            run_id = base.name if rel == "." else f"{base.name}/{rel}"
            issues: list[str] = []
            n_before = len(builder.problems)
            summary = read_summary(run_dir, builder.problems)
            metrics = run_dir / METRICS_NAME
            lines = list(iter_metrics(metrics, builder.problems)) if metrics.is_file() else []
            new = [p.split(": ", 1)[-1] for p in builder.problems[n_before:]]
            if new:
                issues.append(new[0] + (f" (+{len(new) - 1} more)" if len(new) > 1 else ""))
            builder.add_run(run_id, str(run_dir), summary, lines, hydra_identity(run_dir),
                            issues)
    return builder.build([str(p) for p in paths])
