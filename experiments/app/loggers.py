"""Loggers that mirror the run record somewhere else (W&B), chosen by ``_target_`` lists.

As in lightning-hydra-template, ``conf/logger/<option>.yaml`` is a mapping of logger configs,
each with a ``_target_``::

    # conf/logger/wandb.yaml                 # conf/logger/none.yaml
    wandb:                                   # (empty: no logger)
      _target_: experiments.app.loggers.WandbLogger
      project: scalelab
      mode: offline

:func:`experiments.app.build.instantiate_loggers` builds every entry through the restricted instantiate of
``experiments/app/build.py`` (so only allow-listed classes), passing the run's :class:`RunInfo`; the
app never picks a logger by name. A logger has two methods: ``log(row)`` (one ``metrics.jsonl``
line) and ``finish(summary, exit_code)``. The local run record is written by
``experiments/app/records.py`` whatever loggers are configured: a logger is never the only copy.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from experiments import schema
from experiments.app.records import redact

__all__ = ["Logger", "RunInfo", "WandbLogger"]

WANDB_MODES = ("online", "offline", "disabled")


class Logger(Protocol):
    def log(self, row: dict) -> None: ...

    def finish(self, summary: dict, exit_code: int) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a logger may know about the run: where, what (redacted config), how to label it."""

    run_dir: Path
    run_id: str
    config: dict
    group: str
    job_type: str
    name: str
    tags: list[str] = field(default_factory=list)


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
    directory. The W&B run id is derived from ``run.run_id`` (the run directory and its
    generation), so a resumed run continues the same W&B run and a run started over with
    ``train.resume=false`` gets a new one. Only the redacted config is sent. ``WANDB_MODE`` in
    the environment overrides ``mode``; ``disabled`` costs nothing (W&B is not imported).
    """

    def __init__(
        self,
        run: RunInfo,
        project: str = "scalelab",
        entity: str | None = None,
        mode: str = "offline",
        tags: list[str] | None = None,
        system_stats: bool = False,
    ) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"mode must be online, offline or disabled, got {mode!r}")
        mode = os.environ.get("WANDB_MODE") or mode  # W&B's own variable wins
        if not isinstance(project, str) or (entity is not None and not isinstance(entity, str)):
            raise ValueError(f"project and entity must be strings, got {project!r}, {entity!r}")
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags must be a list of strings, got {tags!r}")
        self.run = None
        if mode == "disabled":
            return
        import wandb  # lazy: importing wandb costs about a second

        self._wandb = wandb
        wandb_dir = os.environ.get("WANDB_DIR") or str(run.run_dir)
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            group=run.group,
            job_type=run.job_type,
            tags=sorted(set(run.tags + list(tags or []))),
            name=run.name,
            dir=wandb_dir,
            id=hashlib.sha1(run.run_id.encode()).hexdigest()[:16],
            resume="allow",
            config=redact(run.config),
            settings=wandb.Settings(
                silent=True,
                console="off",
                save_code=False,
                disable_git=True,  # the fingerprint records git already
                x_disable_stats=not system_stats,
                x_disable_machine_info=not system_stats,
            ),
        )

    def log(self, row: dict) -> None:
        if self.run is None:
            return
        hist_key = "act_exp_hist"
        data = {k: v for k, v in row.items() if k not in ("kind", "step", hist_key)}
        hist = row.get(hist_key)
        if hist is not None:
            edges = list(range(hist["lo"], hist["lo"] + len(hist["counts"]) + 1))
            data[hist_key] = self._wandb.Histogram(np_histogram=(hist["counts"], edges))
        prefix = "eval/" if row.get("kind") == schema.KIND_EVAL else "train/"
        self.run.log({prefix + k: v for k, v in _flatten(data).items()}, step=int(row["step"]))

    def finish(self, summary: dict, exit_code: int) -> None:
        if self.run is None:
            return
        for k, v in summary.items():
            if k != "fingerprint" and (v is None or isinstance(v, (int, float, str, bool))):
                self.run.summary[k] = v
        self.run.finish(exit_code=exit_code)
