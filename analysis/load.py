"""Load scalelab run records into tidy pandas DataFrames.

A run record (see ``docs/run-records.md``) is a directory holding ``summary.json`` and
``metrics.jsonl`` next to Hydra's ``.hydra/``. :func:`load_runs` searches one or more sweep
directories recursively and returns a :class:`RunSet` of tidy tables:

* ``runs``        one row per run (the summary, plus per-run aggregates of the step telemetry);
* ``train``       one row per logged training step (scalar keys only);
* ``evals``       one row per evaluation;
* ``layers``      one row per (run, step, layer): ``act_zero_frac``, ``act_subnormal_frac``;
* ``group_scales`` one row per (run, step, scale group) for per-group strategies (``layerwise``);
* ``exp_hist``    one row per (run, step, exponent) of the activation-gradient exponent histogram.

Nothing is dropped silently. Every run found is kept with a ``status``:

``completed``  summary says so and the run did not diverge;
``diverged``   summary ``status == "diverged"`` or ``diverged: true``;
``failed``     an exception ended the run (``error`` holds its message);
``incomplete`` no summary, or the summary still says ``running`` (killed, or still training).

A corrupt line in ``metrics.jsonl`` (bad JSON, not an object, no ``kind``) is skipped and
recorded in :attr:`RunSet.problems`; it is never fatal.

:func:`load_wandb` builds the same tables from the W&B public API (``wandb.Api()``) for one
``entity/project`` and group, when online.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pandas as pd

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"

#: Statuses a run can carry after loading.
STATUSES = ("completed", "diverged", "failed", "incomplete")

#: Columns of the ``runs`` table taken from ``summary.json`` (in this order).
SUMMARY_COLUMNS = (
    "status", "error", "strategy", "precision", "model", "data", "regime", "workload", "seed",
    "sweep", "steps", "final_train_loss", "final_eval_loss", "best_eval_loss",
    "final_eval_metric", "skipped_steps", "mean_step_time_s", "strategy_overhead_s",
    "strategy_overhead_frac", "diverged",
)

#: Scalar keys of a ``kind: "train"`` line kept in the ``train`` table.
TRAIN_SCALARS = (
    "loss", "loss_avg", "scale", "skipped", "skipped_total", "grad_absmax", "grad_norm", "grad_zero_frac",
    "grad_subnormal_frac", "lr", "step_time_s", "strategy_time_s", "probe_time_s",
)

#: Identity columns copied onto every per-step table so each is usable on its own.
ID_COLUMNS = ("run_id", "strategy", "precision", "workload", "seed", "status")


class RunLoadError(ValueError):
    """No run records could be found or read (an empty or missing directory)."""


@dataclass
class RunSet:
    """Tidy tables of a set of runs; see the module docstring for each table's rows."""

    runs: pd.DataFrame
    train: pd.DataFrame
    evals: pd.DataFrame
    layers: pd.DataFrame
    group_scales: pd.DataFrame
    exp_hist: pd.DataFrame
    problems: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.runs)


# --------------------------------------------------------------------------------------------
# Local run directories
# --------------------------------------------------------------------------------------------

def find_run_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """Every run directory under ``root`` (itself included), sorted.

    A run directory is one holding ``summary.json`` or ``metrics.jsonl``, or a Hydra job
    directory (``.hydra/`` present) that wrote neither — a job that died before logging, kept so
    that it is reported instead of vanishing.
    """
    root = Path(root)
    found: set[Path] = set()
    for name in (SUMMARY_FILE, METRICS_FILE):
        found.update(p.parent for p in root.rglob(name))
    for hydra_dir in root.rglob(".hydra"):
        if hydra_dir.is_dir():
            found.add(hydra_dir.parent)
    return sorted(found)


def iter_metrics(path: str | os.PathLike[str], problems: list[str] | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a ``metrics.jsonl`` file, skipping corrupt lines.

    A line is corrupt when it is not valid JSON, not an object, or has no ``kind``/``step``;
    a truncated last line (a run killed mid-write) is the common case. Each one is described in
    ``problems`` as ``"<path>:<line>: <reason>"``.
    """
    path = Path(path)
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                _note(problems, f"{path}:{lineno}: corrupt line skipped ({exc.msg})")
                continue
            if not isinstance(obj, dict) or obj.get("kind") not in ("train", "eval") \
                    or not isinstance(obj.get("step"), (int, float)):
                _note(problems, f"{path}:{lineno}: line skipped (not an object with kind "
                                f"'train'/'eval' and a numeric step)")
                continue
            yield obj


def _note(problems: list[str] | None, msg: str) -> None:
    if problems is not None:
        problems.append(msg)


def _read_summary(run_dir: Path, problems: list[str]) -> dict[str, Any] | None:
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: unreadable summary ({exc}); run labelled incomplete")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{path}: summary is not a JSON object; run labelled incomplete")
        return None
    return obj


def _hydra_identity(run_dir: Path) -> dict[str, Any]:
    """Best-effort identity of a run without a usable summary, from ``.hydra/overrides.yaml``.

    Reads ``key=value`` overrides for ``strategy``, ``precision``, ``model``, ``data``,
    ``regime`` and ``seed`` (a leading ``+``/``++`` and a trailing ``.name`` are ignored).
    """
    path = run_dir / ".hydra" / "overrides.yaml"
    out: dict[str, Any] = {}
    if not path.exists():
        return out
    try:
        import yaml  # PyYAML ships with hydra-core/omegaconf

        overrides = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    except Exception:  # noqa: BLE001 - identity is best effort; the run is still listed
        return out
    for item in overrides if isinstance(overrides, list) else []:
        if not isinstance(item, str) or "=" not in item:
            continue
        key, value = item.split("=", 1)
        key = key.lstrip("+").removesuffix(".name").split("/")[-1]
        if key in ("strategy", "precision", "model", "data", "regime"):
            out[key] = value
        elif key == "seed":
            try:
                out["seed"] = int(value)
            except ValueError:
                pass
    return out


def _classify(summary: Mapping[str, Any] | None) -> str:
    if summary is None:
        return "incomplete"
    status = str(summary.get("status", "running"))
    if status == "failed":
        return "failed"
    if status == "diverged" or bool(summary.get("diverged")):
        return "diverged"
    if status == "completed":
        return "completed"
    return "incomplete"


def _workload(rec: Mapping[str, Any]) -> str | None:
    if rec.get("workload"):
        return str(rec["workload"])
    parts = [rec.get("model"), rec.get("data"), rec.get("regime") or "plain"]
    if parts[0] is None or parts[1] is None:
        return None
    return "/".join(str(p) for p in parts)


class _Builder:
    """Accumulates rows of every table while runs are read one after another."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []
        self.train: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.layers: list[dict[str, Any]] = []
        self.group_scales: list[dict[str, Any]] = []
        self.exp_hist: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def add_run(self, run_id: str, run_dir: str, summary: Mapping[str, Any] | None,
                lines: Iterable[Mapping[str, Any]], identity: Mapping[str, Any] | None = None
                ) -> None:
        rec: dict[str, Any] = {"run_id": run_id, "run_dir": run_dir}
        src: dict[str, Any] = dict(identity or {})
        if summary:
            src.update({k: v for k, v in summary.items() if v is not None})
        for col in SUMMARY_COLUMNS:
            rec[col] = src.get(col)
        rec["status"] = _classify(summary)
        rec["summary_status"] = None if summary is None else summary.get("status")
        rec["workload"] = _workload(src)
        rec["regime"] = src.get("regime") or ("plain" if rec["workload"] else None)
        fp = (summary or {}).get("fingerprint") or {}
        rec["git_sha"] = fp.get("git_sha") if isinstance(fp, dict) else None
        if rec["error"] is None and rec["status"] == "incomplete":
            rec["error"] = ("no summary.json" if summary is None
                            else "summary still says 'running' (killed or still training)")
        ident = {k: rec[k] for k in ID_COLUMNS}

        n_train = n_eval = 0
        zero_fracs: list[float] = []
        sub_fracs: list[float] = []
        last_eval: float | None = None
        for line in lines:
            step = int(line["step"])
            if line["kind"] == "eval":
                n_eval += 1
                row = dict(ident, step=step, eval_loss=_num(line.get("eval_loss")),
                           eval_metric=_num(line.get("eval_metric")))
                last_eval = row["eval_loss"]
                self.evals.append(row)
                continue
            n_train += 1
            row = dict(ident, step=step)
            for key in TRAIN_SCALARS:
                row[key] = _num(line.get(key)) if key != "skipped" else _bool(line.get(key))
            self.train.append(row)
            self._add_layers(ident, step, line, zero_fracs, sub_fracs)
            self._add_group_scales(ident, step, line)
            self._add_hist(ident, step, line.get("act_exp_hist"))
        rec["n_train_lines"] = n_train
        rec["n_eval_lines"] = n_eval
        rec["act_zero_frac_mean"] = _mean(zero_fracs)
        rec["act_subnormal_frac_mean"] = _mean(sub_fracs)
        if rec["final_eval_loss"] is None and rec["status"] == "incomplete":
            rec["last_eval_loss"] = last_eval
        self.runs.append(rec)

    def _add_layers(self, ident: dict[str, Any], step: int, line: Mapping[str, Any],
                    zero_fracs: list[float], sub_fracs: list[float]) -> None:
        zero = line.get("act_zero_frac") or {}
        sub = line.get("act_subnormal_frac") or {}
        if not isinstance(zero, dict) or not isinstance(sub, dict):
            return
        step_zero = [v for v in (_num(x) for x in zero.values()) if v is not None]
        step_sub = [v for v in (_num(x) for x in sub.values()) if v is not None]
        if step_zero:
            zero_fracs.append(sum(step_zero) / len(step_zero))
        if step_sub:
            sub_fracs.append(sum(step_sub) / len(step_sub))
        for order, layer in enumerate(dict.fromkeys([*zero, *sub])):
            self.layers.append(dict(ident, step=step, layer=str(layer), layer_order=order,
                                    act_zero_frac=_num(zero.get(layer)),
                                    act_subnormal_frac=_num(sub.get(layer))))

    def _add_group_scales(self, ident: dict[str, Any], step: int, line: Mapping[str, Any]) -> None:
        scales = line.get("scales")
        if not isinstance(scales, list):
            return
        names = line.get("scale_groups")
        if not isinstance(names, list) or len(names) != len(scales):
            names = [f"group{i}" for i in range(len(scales))]
        for order, (name, value) in enumerate(zip(names, scales)):
            self.group_scales.append(dict(ident, step=step, group=str(name), group_order=order,
                                          scale=_num(value)))

    def _add_hist(self, ident: dict[str, Any], step: int, hist: Any) -> None:
        if not isinstance(hist, dict) or not isinstance(hist.get("counts"), list):
            return
        try:
            lo = int(hist.get("lo", 0))
        except (TypeError, ValueError):
            return
        zeros = _num(hist.get("zeros")) or 0.0
        for i, count in enumerate(hist["counts"]):
            c = _num(count)
            if c:
                self.exp_hist.append(dict(ident, step=step, exponent=lo + i, count=c,
                                          zeros=zeros))
        # Keep the zeros of a histogram with no nonzero bins too (all gradients underflowed).
        if not any(_num(c) for c in hist["counts"]):
            self.exp_hist.append(dict(ident, step=step, exponent=None, count=0.0, zeros=zeros))

    def build(self, sources: Sequence[str]) -> RunSet:
        runs = pd.DataFrame(self.runs)
        if not runs.empty:
            runs = runs.sort_values(["workload", "precision", "strategy", "seed", "run_id"],
                                    na_position="last", key=_sort_key).reset_index(drop=True)
        return RunSet(
            runs=runs,
            train=_frame(self.train, ["run_id", "step"]),
            evals=_frame(self.evals, ["run_id", "step"]),
            layers=_frame(self.layers, ["run_id", "step", "layer_order"]),
            group_scales=_frame(self.group_scales, ["run_id", "step", "group_order"]),
            exp_hist=_frame(self.exp_hist, ["run_id", "step", "exponent"]),
            problems=list(self.problems),
            sources=list(sources),
        )


def _sort_key(col: pd.Series) -> pd.Series:
    return col.astype(str) if col.name != "seed" else pd.to_numeric(col, errors="coerce")


def _frame(rows: list[dict[str, Any]], order: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=[*ID_COLUMNS, *order[1:]])
    return df.sort_values(order, na_position="first").reset_index(drop=True)


def _num(x: Any) -> float | None:
    """A JSON number as float (NaN/Infinity kept), anything else as None."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _bool(x: Any) -> bool | None:
    return None if x is None else bool(x)


def _mean(xs: list[float]) -> float | None:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else None


def load_runs(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> RunSet:
    """Load every run under one or more (multi)run directories.

    ``run_id`` is the run directory relative to the sweep directory given, prefixed by that
    directory's name (``compare/3``), so runs of several sweeps stay distinct.

    Raises :class:`RunLoadError` when a path does not exist or holds no run record at all.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise RunLoadError("no run directory given")
    builder = _Builder()
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise RunLoadError(f"run directory does not exist: {root}")
        if not root.is_dir():
            raise RunLoadError(f"not a directory: {root}")
        run_dirs = find_run_dirs(root)
        if not run_dirs:
            raise RunLoadError(f"no run records (summary.json / metrics.jsonl) under {root}")
        base = root.resolve()
        for run_dir in run_dirs:
            rel = run_dir.resolve().relative_to(base).as_posix()
            run_id = base.name if rel == "." else f"{base.name}/{rel}"
            summary = _read_summary(run_dir, builder.problems)
            identity = _hydra_identity(run_dir) if summary is None or not summary.get(
                "strategy") else None
            metrics = run_dir / METRICS_FILE
            lines = iter_metrics(metrics, builder.problems) if metrics.exists() else []
            builder.add_run(run_id, str(run_dir), summary, lines, identity)
    return builder.build([str(p) for p in paths])


# --------------------------------------------------------------------------------------------
# Weights & Biases
# --------------------------------------------------------------------------------------------

def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"act_zero_frac/head": x}`` → ``{"act_zero_frac": {"head": x}}`` (one level, as the
    W&B logger of ``experiments/records.py`` flattens the run-record dicts)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, sep, tail = key.partition("/")
        if sep:
            nested = out.setdefault(head, {})
            if isinstance(nested, dict):
                nested[tail] = value
        else:
            out[key] = value
    return out


def _wandb_hist(value: Any) -> dict[str, Any] | None:
    """A logged ``wandb.Histogram`` (``{"_type": "histogram", "values", "bins"}``) back to the
    run-record form ``{"lo", "counts", "zeros"}``; the unit-width bins start at ``bins[0]``.
    W&B does not carry the exact-zero count, so ``zeros`` is 0 here."""
    if isinstance(value, dict) and isinstance(value.get("values"), list) \
            and isinstance(value.get("bins"), list) and value["bins"]:
        return {"lo": int(round(value["bins"][0])), "counts": list(value["values"]), "zeros": 0}
    return None


def wandb_rows_to_lines(history: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Turn W&B history rows back into run-record lines.

    The training app logs each line's keys under ``train/`` or ``eval/`` with nested dicts
    flattened to ``act_zero_frac/<layer>`` and ``step`` as W&B's ``_step``; W&B merges a train
    and an eval line of the same step into one row, so a row can yield both lines (train
    first). Rows already in run-record form (with ``kind``) pass through.
    """
    for row in history:
        step = row.get("step", row.get("_step"))
        if not isinstance(step, (int, float)):
            continue
        if row.get("kind") in ("train", "eval"):
            yield dict(row, step=step)
            continue
        for kind in ("train", "eval"):
            prefix = kind + "/"
            flat = {k[len(prefix):]: v for k, v in row.items()
                    if k.startswith(prefix) and v is not None}
            if not flat:
                continue
            line = _nest(flat)
            if "act_exp_hist" in line:
                hist = _wandb_hist(line["act_exp_hist"])
                if hist is None:
                    line.pop("act_exp_hist")
                else:
                    line["act_exp_hist"] = hist
            line.update(kind=kind, step=int(step))
            yield line


def load_wandb(path: str, group: str | None = None, *, api: Any = None) -> RunSet:
    """Load the runs of a W&B ``entity/project`` (optionally one ``group``) via the public API.

    Each W&B run's summary is read as ``summary.json`` (the app mirrors every scalar summary
    key; the fingerprint stays local) and its full history (``scan_history``) as
    ``metrics.jsonl`` (see :func:`wandb_rows_to_lines`); the W&B run state ``crashed``/``failed`` marks a run failed when its
    summary has no final status, ``running`` marks it incomplete. ``api`` may be a
    ``wandb.Api``-compatible object (for tests).

    Raises :class:`RunLoadError` with a one-line reason when W&B is offline/disabled, the path
    is malformed, or the API cannot be reached.
    """
    if path.count("/") != 1 or not all(path.split("/")):
        raise RunLoadError(f"W&B path must be 'entity/project', got {path!r}")
    if api is None:
        mode = os.environ.get("WANDB_MODE", "").lower()
        if mode in ("offline", "disabled", "dryrun"):
            raise RunLoadError(f"cannot read W&B runs of {path}: WANDB_MODE={mode}; "
                               "read the local run directories instead")
        try:
            import wandb

            api = wandb.Api(timeout=30)
        except Exception as exc:  # noqa: BLE001 - any failure here means "not reachable"
            raise RunLoadError(f"cannot reach the W&B API for {path}: "
                               f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    filters = {"group": group} if group else None
    builder = _Builder()
    try:
        wb_runs = list(api.runs(path, filters=filters))
    except Exception as exc:  # noqa: BLE001
        raise RunLoadError(f"cannot list W&B runs of {path}: {type(exc).__name__}: {exc}"
                           .splitlines()[0]) from exc
    if not wb_runs:
        raise RunLoadError(f"no W&B runs in {path}" + (f" group {group!r}" if group else ""))
    for run in wb_runs:
        summary = {k: v for k, v in dict(run.summary).items()
                   if not k.startswith("_") and "/" not in k}
        config = dict(getattr(run, "config", {}) or {})
        for key in ("strategy", "precision", "model", "data", "regime", "seed"):
            if summary.get(key) is None and not isinstance(config.get(key), dict):
                summary.setdefault(key, config.get(key))
        state = getattr(run, "state", None)
        if summary.get("status") is None:
            summary["status"] = {"crashed": "failed", "failed": "failed",
                                 "finished": "completed"}.get(state, "running")
        summary.setdefault("sweep", group or getattr(run, "group", None))
        lines = list(wandb_rows_to_lines(run.scan_history()))
        builder.add_run(f"{path}/{run.id}", getattr(run, "url", ""), summary, lines)
    return builder.build([f"wandb:{path}" + (f"?group={group}" if group else "")])
