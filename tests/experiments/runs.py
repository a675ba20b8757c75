"""Helpers for the training-app tests: tiny configs, in-process runs, and CLI subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from experiments.app.loop import run
from experiments.app.train import CONF_DIR

DOC = CONF_DIR.parent / "docs" / "run-records.md"
"""The run-record format page, whose tables list the schema's fields."""


def documented(start: str, end: str) -> set[str]:
    """The backticked keys of the table rows of DOC's section from ``start`` to ``end``."""
    text = DOC.read_text()
    section = text[text.index(start): text.index(end, text.index(start))]
    keys: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    return keys


REPO = CONF_DIR.parent

# Tiny sizes per model: a few hundred thousand FLOPs per step, so a run is well under a second.
TINY = {
    "gpt": [
        "model=gpt", "data=stdlib_chars", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "data.block_size=16", "data.max_bytes=60000", "data.eval_batch_size=16", "train.batch_size=8",
    ],
    "mlp": [
        "model=mlp", "data=vectors", "model.width=32", "model.depth=2", "data.in_features=16",
        "data.n_train=512", "data.n_val=256", "train.batch_size=32",
    ],
    "cnn": [
        "model=cnn", "data=images", "model.width=4", "model.depth=2", "data.image_size=8",
        "data.max_shift=1", "data.n_train=256", "data.n_val=128", "train.batch_size=16",
    ],
}
QUIET = ["logger=none", "train.progress=false", "train.eval_batches=2", "threads=1"]


def compose_cfg(*overrides: str) -> DictConfig:
    """The config ``scalelab-train`` would build from these overrides (compose API)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def compose_with_choices(*overrides: str) -> tuple[DictConfig, dict]:
    """The task config as the app gets it, and Hydra's ``runtime.choices`` (the options chosen)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


def run_tiny(run_dir: Path, *overrides: str, model: str = "mlp") -> tuple[dict, list[dict]]:
    """Train a tiny ``model`` in-process with ``overrides``; return (summary, metrics rows)."""
    cfg, choices = compose_with_choices(*TINY[model], *QUIET, *overrides)
    summary = run(cfg, run_dir, list(overrides), choices)
    return summary, read_rows(run_dir)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m experiments.app.train ARGS`` in a subprocess (W&B disabled, repo importable)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", HYDRA_FULL_ERROR="")
    env.pop("HYDRA_FULL_ERROR")
    return subprocess.run(
        [sys.executable, "-m", "experiments.app.train", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
