"""Read scalelab run records (local sweep directories) into tidy pandas DataFrames.

A run record (see ``docs/run-records.md``; file names and keys from :mod:`experiments.schema`) is
a directory holding ``summary.json`` and ``metrics.jsonl`` next to Hydra's ``.hydra/``.
:func:`load_runs` searches one or more sweep directories recursively and returns a
:class:`~analysis.runset.RunSet` (tables described there).

Nothing is dropped silently and no record content can make loading fail: an unreadable file or
directory, a file that is not a regular file, a file over its read limit, a non-object summary,
a line that is not JSON, not an object, of no known kind or without an integral step, a value of
the wrong type or an integer beyond float range, bytes that are not UTF-8 — each is skipped,
cut or set to missing, and said in one line (:attr:`RunSet.problems`, "bad records", one per
file or directory; the ``issues`` column per run).

**Limits** (per file; ``docs/report.md``): a ``summary.json`` over :data:`MAX_SUMMARY_BYTES`
is not read (listed; the run counts as incomplete), nor a ``diagnosis.json`` over
:data:`MAX_DIAGNOSIS_BYTES` (listed; the run shows no diagnosis); ``metrics.jsonl`` is streamed line by line,
a line over :data:`MAX_LINE_BYTES` is skipped (listed) and reading stops after
:data:`MAX_METRICS_BYTES` (listed; the lines before it are kept); ``.hydra/overrides.yaml`` is
read up to :data:`MAX_OVERRIDES_BYTES`. The per-step tables of all runs together hold at most
:data:`analysis.runset.MAX_STEP_ROWS` rows; lines past it are not tabulated (listed).

:func:`load_wandb` (in :mod:`analysis.wandb_runs`) builds the same tables from the W&B API.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import yaml  # PyYAML ships with hydra-core/omegaconf

from experiments.schema import DIAGNOSIS_NAME, METRICS_NAME, SUMMARY_NAME

from analysis.records import line_problem, parse_json
from analysis.runset import IDENTITY_KEYS, Builder, RunLoadError, RunSet
from analysis.wandb_runs import load_wandb, wandb_rows_to_lines

__all__ = ["MAX_DIAGNOSIS_BYTES", "MAX_LINE_BYTES", "MAX_METRICS_BYTES", "MAX_OVERRIDES_BYTES", "MAX_SUMMARY_BYTES",
           "RunLoadError", "RunSet", "find_run_dirs", "iter_metrics", "load_runs", "load_wandb",
           "wandb_rows_to_lines"]

MiB = 2**20
#: Largest ``summary.json`` read (a real one is a few kB; its config is most of it).
MAX_SUMMARY_BYTES = 16 * MiB
#: Largest ``diagnosis.json`` read (a real one is a few kB: one row per layer and scale).
MAX_DIAGNOSIS_BYTES = 1 * MiB
#: Longest ``metrics.jsonl`` line read (a real one is under 10 kB).
MAX_LINE_BYTES = 1 * MiB
#: Most bytes of one ``metrics.jsonl`` read (about 100k logged steps of a 12-layer model).
MAX_METRICS_BYTES = 64 * MiB
#: Largest ``.hydra/overrides.yaml`` read.
MAX_OVERRIDES_BYTES = 1 * MiB
#: Most corrupt lines of one file listed one by one (the rest are counted in one line).
MAX_LINE_PROBLEMS = 5


class RecordError(OSError):
    """A record file that cannot be read as a regular file within its limit."""


def _size(n: int) -> str:
    if n < MiB:
        return f"{n} bytes"
    return f"{n / MiB:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def open_record(path: Path) -> BinaryIO:
    """``path`` opened for binary reading, refusing anything but a regular file (a FIFO, a
    device or a socket could block or never end); raises :class:`OSError` (e.g.
    ``PermissionError``) or :class:`RecordError`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO never blocks
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RecordError(f"not a regular file (mode {stat.filemode(mode)})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: Path, limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes; :class:`RecordError` naming the
    size when it is larger (nothing over the limit is read)."""
    with open_record(path) as fh:
        data = fh.read(limit + 1)
        if len(data) > limit:
            size = os.fstat(fh.fileno()).st_size
            raise RecordError(f"{_size(max(size, len(data)))}, over the {_size(limit)} read "
                              "limit; not read")
    return data


def _why(exc: BaseException) -> str:
    """One line for an error while reading a file."""
    if isinstance(exc, RecordError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def find_run_dirs(root: str | os.PathLike[str], problems: list[str] | None = None
                  ) -> list[Path]:
    """Every run directory under ``root`` (itself included), sorted.

    A run directory is one holding ``summary.json`` or ``metrics.jsonl``, or a Hydra job
    directory (``.hydra/`` present) that wrote neither — a job that died before logging, kept so
    that it is reported instead of vanishing. Symbolic links to directories are not followed.
    A directory that cannot be listed is said in ``problems`` (``"<dir>: unreadable directory
    (PermissionError: …); not searched"``).
    """
    found: set[Path] = set()

    def unreadable(exc: OSError) -> None:
        if problems is not None:
            problems.append(f"{exc.filename}: unreadable directory ({_why(exc)}); not searched")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        if SUMMARY_NAME in filenames or METRICS_NAME in filenames or ".hydra" in dirnames:
            found.add(Path(dirpath))
    return sorted(found)


def iter_metrics(path: str | os.PathLike[str], problems: list[str] | None = None, *,
                 max_bytes: int = MAX_METRICS_BYTES, max_line: int = MAX_LINE_BYTES
                 ) -> Iterator[dict[str, Any]]:
    """Yield the usable JSON objects of a ``metrics.jsonl`` file, streaming, skipping bad lines.

    A line is bad when it is longer than ``max_line`` bytes, not valid JSON, or
    :func:`analysis.records.line_problem` rejects it; a truncated last line (a run killed
    mid-write) is the common case. Each one is described in ``problems`` as
    ``"<path>:<line>: <reason>"`` (the first few per file, then a count). Reading stops after
    ``max_bytes`` (said in one line; the lines before are kept). Bytes that are not UTF-8 are
    replaced, never fatal. A file that cannot be opened is one line in ``problems``; a missing one yields nothing.
    """
    path = Path(path)
    skipped = 0
    read = 0
    lineno = 0

    def bad(reason: str) -> None:
        nonlocal skipped
        skipped += 1
        if problems is not None and skipped <= MAX_LINE_PROBLEMS:
            problems.append(f"{path}:{lineno}: {reason}")

    try:
        fh = open_record(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if problems is not None:
            problems.append(f"{path}: unreadable metrics ({_why(exc)}); no step data")
        return
    def over(what: str) -> None:
        if problems is not None:
            problems.append(f"{path}: over the {_size(max_bytes)} read limit; {what} ignored")

    with fh:
        try:
            while True:
                if read >= max_bytes:
                    if fh.read(1):
                        over(f"lines after line {lineno}")
                    break
                raw = fh.readline(min(max_line, max_bytes - read) + 1)
                if not raw:
                    break
                lineno += 1
                read += len(raw)
                if len(raw) > max_line:
                    while raw and not raw.endswith(b"\n") and read < max_bytes:  # skip the rest
                        raw = fh.readline(min(MiB, max_bytes - read))
                        read += len(raw)
                    bad(f"line longer than {_size(max_line)} skipped")
                    continue
                if not raw.endswith(b"\n") and read >= max_bytes and fh.read(1):
                    over(f"line {lineno} (cut there) and later lines")
                    break
                text = raw.strip()
                if not text:
                    continue
                try:
                    obj = parse_json(text)
                except (ValueError, RecursionError) as exc:
                    bad("corrupt line skipped "
                        f"({getattr(exc, 'msg', None) or 'nested too deep'})")
                    continue
                why = line_problem(obj)
                if why is None:
                    yield obj
                else:
                    bad(f"line skipped ({why})")
        except OSError as exc:  # an I/O error mid-file (a failing disk, a vanished mount)
            if problems is not None:
                problems.append(f"{path}:{lineno}: read error ({_why(exc)}); the rest ignored")
    if problems is not None and skipped > MAX_LINE_PROBLEMS:
        problems.append(f"{path}: {skipped - MAX_LINE_PROBLEMS} more corrupt lines skipped")


def read_object(path: Path, limit: int, what: str, consequence: str, problems: list[str]
                ) -> dict[str, Any] | None:
    """The parsed JSON object in ``path`` when it is one within ``limit`` bytes, else ``None``
    (with ``"<path>: unreadable <what> (<reason>); <consequence>"`` or ``"<path>: <what> is a
    JSON list, not an object; <consequence>"`` in ``problems`` unless the file does not exist)."""
    try:
        data = read_capped(path, limit)
        obj = parse_json(data)
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError, OSError) as exc:
        reason = "empty" if isinstance(exc, ValueError) and not data.strip() else _why(exc)
        problems.append(f"{path}: unreadable {what} ({reason}); {consequence}")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{path}: {what} is a JSON {type(obj).__name__}, not an object; "
                        f"{consequence}")
        return None
    return obj


def read_summary(run_dir: Path, problems: list[str]) -> dict[str, Any] | None:
    """The parsed ``summary.json`` of ``run_dir`` within :data:`MAX_SUMMARY_BYTES`
    (:func:`read_object`; a bad one labels the run incomplete)."""
    return read_object(run_dir / SUMMARY_NAME, MAX_SUMMARY_BYTES, "summary",
                       "run labelled incomplete", problems)


def read_diagnosis(run_dir: Path, problems: list[str]) -> dict[str, Any] | None:
    """The parsed ``diagnosis.json`` of ``run_dir`` within :data:`MAX_DIAGNOSIS_BYTES`
    (:func:`read_object`; a bad one is listed and the run shows no diagnosis)."""
    return read_object(run_dir / DIAGNOSIS_NAME, MAX_DIAGNOSIS_BYTES, "diagnosis",
                       "no diagnosis shown", problems)


def hydra_identity(run_dir: Path, problems: list[str]) -> dict[str, Any]:
    """Best-effort identity of a run from ``.hydra/overrides.yaml`` (``key=value`` items for
    ``strategy``, ``precision``, ``model``, ``data``, ``regime``, ``seed``; a leading ``+``/``++``
    and a trailing ``.name`` are ignored); the builder coerces it like a summary. A file that
    exists but cannot be read (permissions, over :data:`MAX_OVERRIDES_BYTES`) is said in
    ``problems``; one that does not parse gives no identity."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        data = read_capped(path, MAX_OVERRIDES_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        problems.append(f"{path}: unreadable overrides ({_why(exc)}); identity from the "
                        "summary only")
        return {}
    try:

        overrides = yaml.safe_load(data.decode("utf-8", errors="replace")) or []
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
        n_before = len(builder.problems)
        run_dirs = find_run_dirs(root, builder.problems)
        if not run_dirs:
            unread = builder.problems[n_before:]
            raise RunLoadError(f"no run records ({SUMMARY_NAME} / {METRICS_NAME}) under {root}"
                               + (f"; {unread[0]}" if unread else ""))
        base = root.resolve()
        for run_dir in run_dirs:
            rel = run_dir.resolve().relative_to(base).as_posix()
            run_id = base.name if rel == "." else f"{base.name}/{rel}"
            n_before = len(builder.problems)
            summary = read_summary(run_dir, builder.problems)
            identity = hydra_identity(run_dir, builder.problems)
            diag = read_diagnosis(run_dir, builder.problems)
            lines = iter_metrics(run_dir / METRICS_NAME, builder.problems)
            builder.add_run(run_id, str(run_dir), summary, lines, identity,
                            problems_from=n_before, raw_diagnosis=diag)
    return builder.build([str(p) for p in paths])
