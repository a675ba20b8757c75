"""Read the runs of a W&B group into the same tidy tables as local run directories.

The training app logs each run-record line's keys under ``train/``, ``eval/`` or ``fidelity/``
(nested dicts flattened with ``/``); :func:`wandb_rows_to_lines` turns history rows back into
run-record lines, which then go through the same schema coercion as local files
(:class:`analysis.runset.Builder`).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Mapping

from experiments.schema import KIND_EVAL, KIND_FIDELITY, KIND_TRAIN

from analysis.runset import IDENTITY_KEYS, Builder, RunLoadError, RunSet

__all__ = ["KINDS", "load_wandb", "wandb_rows_to_lines"]

KINDS = (KIND_TRAIN, KIND_EVAL, KIND_FIDELITY)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"act_zero_frac/head": x}`` → ``{"act_zero_frac": {"head": x}}`` (one level, as the
    app's W&B logger flattens the run-record dicts)."""
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
            and isinstance(value.get("bins"), list) and value["bins"] \
            and isinstance(value["bins"][0], (int, float)):
        return {"lo": int(round(value["bins"][0])), "counts": list(value["values"]), "zeros": 0}
    return None


def wandb_rows_to_lines(history: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Turn W&B history rows back into run-record lines.

    ``step`` is W&B's ``_step``; W&B merges lines of one step into one row, so a row can yield
    several lines (train first). Rows already in run-record form (with ``kind``) pass through.
    """
    for row in history:
        step = row.get("step", row.get("_step"))
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            continue
        if row.get("kind") in KINDS:
            yield dict(row, step=step)
            continue
        for kind in KINDS:
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
    ``metrics.jsonl``; the W&B run state ``crashed``/``failed`` marks a run failed when its
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
    builder = Builder()
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
        identity = {k: config.get(k) for k in IDENTITY_KEYS if not isinstance(config.get(k), dict)}
        state = getattr(run, "state", None)
        if summary.get("status") is None:
            summary["status"] = {"crashed": "failed", "failed": "failed",
                                 "finished": "completed"}.get(state, "running")
        summary.setdefault("sweep", group or getattr(run, "group", None))
        lines = list(wandb_rows_to_lines(run.scan_history()))
        builder.add_run(f"{path}/{run.id}", getattr(run, "url", ""), summary, lines, identity)
    return builder.build([f"wandb:{path}" + (f"?group={group}" if group else "")])
