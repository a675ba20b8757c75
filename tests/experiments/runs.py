"""Helpers for the training-app tests: tiny configs, in-process runs, and CLI subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
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

PRETRAINED_DIR = Path(tempfile.gettempdir()) / f"scalelab-tests-pretrained-{os.getuid()}"
"""Where the tests' tiny pretrained GPTs are cached (experiments/workloads/pretrained.py): made once per machine."""
PRETRAINED_TINY = ["model.block_size=8", "model.n_embd=8", "model.n_head=2", "model.pretrain_steps=3",
                   "model.pretrain_batch_size=4", "model.pretrain_warmup=1", "model.pretrain_max_bytes=20000",
                   f"model.cache_dir={PRETRAINED_DIR}"]

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
    "pretrainedgpt": [  # the finetune workload's model and text, pretrained for 3 steps (cached once per machine)
        "model=gpt_pretrained", "data=finetune_chars", *PRETRAINED_TINY, "data.block_size=8", "data.max_bytes=20000",
        "data.eval_batch_size=16", "train.batch_size=8",
    ],
    "rl": [  # the rl workload: 2 prompts x 4 samples, 4 + 4 bytes
        "model=gpt_pretrained", "data=rl_vowels", *PRETRAINED_TINY, "data.prompts=2", "data.group_size=4",
        "data.prompt_len=4", "data.completion_len=4", "data.eval_prompts=8", "data.max_bytes=20000",
        "data.eval_batch_size=16", "train.checkpoint_every=0",
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
