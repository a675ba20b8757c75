"""In-process training runs for the checks (``make replay-check``, ``make warning-eval``): a run
composed from overrides as ``scalelab-train`` composes it and trained in this process (no Hydra
start-up per run). A run directory that already holds the finished run of the same overrides is reused as it is, so a
check re-run trains only what is missing; one of other overrides is trained again (the app moves
the old records aside: ``replaced-<n>/``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from experiments import schema
from experiments.app.loop import run
from experiments.app.train import CONF_DIR

__all__ = ["train", "finished"]


def finished(run_dir: Path, overrides: list[str] | None = None) -> dict[str, Any] | None:
    """The final summary of a finished run in ``run_dir`` (None: none, still running, or — when
    ``overrides`` are given — a run of other overrides)."""
    path = run_dir / schema.SUMMARY_NAME
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if overrides is not None and (summary.get("fingerprint") or {}).get("overrides") != list(overrides):
        return None
    return summary if summary.get("status") not in (None, "running", "requeued") else None


def train(run_dir: Path, overrides: list[str], log: Any = print) -> dict[str, Any]:
    """Train the run ``overrides`` describes into ``run_dir`` (or reuse it, finished); its summary (also of a
    run that raised after writing it: a strategy's ``on_min_scale: raise`` ends the run ``failed``)."""
    done = finished(run_dir, overrides)
    if done is not None:
        return done
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    t0 = time.perf_counter()
    try:
        summary = run(cfg, run_dir, list(overrides), choices)
    except Exception:  # noqa: BLE001 - a run that stops by raising (on_min_scale: raise) recorded its summary
        summary = finished(run_dir, overrides)
        if summary is None:
            raise
    log(f"  {run_dir}: {summary['status']} at step {summary['steps']}, {summary['skipped_steps']} skipped "
        f"({time.perf_counter() - t0:.0f} s)")
    return summary
