"""Run records (``metrics.jsonl``, ``summary.json``) and the W&B mirror — see ``docs/run-records.md``.

``metrics.jsonl`` is appended and flushed line by line, so a killed run keeps what it wrote; on
resume it is truncated back to the checkpoint's step (:func:`truncate_metrics`) so the record has
no duplicate steps. ``summary.json`` is written atomically at start (``running``) and at the end;
its numbers are computed from ``metrics.jsonl`` itself plus the loop's host counters, so a resumed
run summarises its whole history. W&B, when on, gets the same keys; it is never the only copy,
and nothing secret (API keys, tokens) is ever written to a record.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MetricsWriter",
    "WandbLogger",
    "read_json",
    "read_metrics",
    "truncate_metrics",
    "write_json_atomic",
    "summarize",
    "fingerprint",
    "redact",
]

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
_SECRET = re.compile(r"(api[_-]?key|token|secret|password|passwd)", re.IGNORECASE)
_REPO_ROOT = Path(__file__).resolve().parent.parent


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


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def read_json(path: str | Path) -> dict:
    """A JSON file as a dict (``{}`` when it does not exist)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def read_metrics(path: str | Path) -> list[dict]:
    """All complete JSON lines of a ``metrics.jsonl`` (a torn last line from a kill is dropped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: str | Path, step: int) -> int:
    """Keep only the lines with ``step <= step`` (atomic rewrite); return how many were dropped."""
    path = Path(path)
    rows = read_metrics(path)
    kept = [r for r in rows if int(r.get("step", 0)) <= step]
    if path.exists():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return len(rows) - len(kept)


class MetricsWriter:
    """Append-and-flush writer of ``metrics.jsonl`` lines (a no-op on non-main ranks)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._f = open(self.path, "a") if self.path is not None else None

    def write(self, row: dict) -> None:
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


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
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
        "torch_version": torch.__version__,
        "device": device,
        "hostname": socket.gethostname(),
    }


def _finite_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize(rows: list[dict], counters: dict) -> dict:
    """The metric part of ``summary.json`` from the ``metrics.jsonl`` rows and host counters.

    ``counters``: ``steps``, ``skipped_steps``, ``timed_steps``, ``step_time_sum``,
    ``strategy_time_sum`` (sums over the steps after ``warmup``).
    """
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
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
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "mean_step_time_s": mean_step,
        "strategy_overhead_s": overhead,
        "strategy_overhead_frac": (overhead / mean_step) if (overhead is not None and mean_step) else None,
    }


def _flatten(row: dict, prefix: str = "") -> dict:
    """``{"act_zero_frac": {"head": x}}`` -> ``{"act_zero_frac/head": x}`` (W&B panel names)."""
    out: dict = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


class WandbLogger:
    """Mirror of the run record in Weights & Biases (``conf/logger/wandb.yaml``).

    ``group`` = the sweep name, ``job_type`` = the strategy, ``tags`` = precision, model, data,
    regime plus the configured ones. Files go to ``$WANDB_DIR`` when set, else to the run
    directory. The run id is derived from the run directory, so a resumed run continues the same
    W&B run. Only the redacted config is sent.
    """

    def __init__(
        self,
        run_dir: Path,
        logger_cfg: dict,
        config: dict,
        *,
        group: str,
        job_type: str,
        tags: list[str],
        name: str,
    ) -> None:
        import wandb  # lazy: importing wandb costs about a second

        self._wandb = wandb
        wandb_dir = os.environ.get("WANDB_DIR") or str(run_dir)
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=logger_cfg.get("project", "scalelab"),
            entity=logger_cfg.get("entity"),
            mode=logger_cfg.get("mode", "offline"),
            group=group,
            job_type=job_type,
            tags=sorted(set(tags)),
            name=name,
            dir=wandb_dir,
            id=run_id,
            resume="allow",
            config=redact(config),
            settings=wandb.Settings(
                silent=True,
                console="off",
                save_code=False,
                disable_git=True,  # the fingerprint records git already
                x_disable_stats=not logger_cfg.get("system_stats", False),
                x_disable_machine_info=not logger_cfg.get("system_stats", False),
            ),
        )

    def log(self, row: dict) -> None:
        data = {k: v for k, v in row.items() if k not in ("kind", "step", "act_exp_hist")}
        hist = row.get("act_exp_hist")
        if hist is not None:
            edges = list(range(hist["lo"], hist["lo"] + len(hist["counts"]) + 1))
            data["act_exp_hist"] = self._wandb.Histogram(np_histogram=(hist["counts"], edges))
        prefix = "eval/" if row.get("kind") == "eval" else "train/"
        self.run.log({prefix + k: v for k, v in _flatten(data).items()}, step=int(row["step"]))

    def finish(self, summary: dict, exit_code: int) -> None:
        for k, v in summary.items():
            if k != "fingerprint" and (v is None or isinstance(v, (int, float, str, bool))):
                self.run.summary[k] = v
        self.run.finish(exit_code=exit_code)
