"""``scalelab-doctor RUN_DIR``: diagnose the last step of a recorded run (``strategies.doctor``).

The run directory's checkpoint (loaded with ``weights_only=True``) and the configuration it
recorded rebuild the model, its weights, the strategy (hence the current loss scale) and the
batch of the checkpoint's step (batches are a function of ``(seed, step)``,
``experiments/workloads/data.py``); the loss is the training loop's: mean cross-entropy in fp32 times the
regime's loss multiplier (and spike factor on its spike steps), i.e. what the scaled backward
differentiated. The learning-rate history is the configured schedule up to that step.

A checkpoint holds no ``.grad``, so ``grads_not_cleared`` cannot be diagnosed from a run
directory (the API can: call ``diagnose`` inside the loop before ``zero_grad``).

Output: the verdict as text (``--json`` for tools). Exit status: the verdict's code
(``strategies.doctor.EXIT_CODES``: 0 healthy, 1 scale overflow (benign), 3 forward overflow,
4 NaN/Inf in data or loss, 5 gradients not cleared, 6 learning-rate spike, 7 gradient overflow,
8 underflow, 9 block clipping) or 2 for a missing, foreign or corrupt run directory or a bad command line, with
one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.app import checkpoint as ckpt
from experiments.app import recipe
from experiments import schema
from experiments.app.build import AppError, build_data, build_model, build_precision, build_strategy, one_line
from experiments.doctor.diagnosis import doctor_precision
from experiments.app.config import RunConfig
from experiments.workloads.data import step_generator
from experiments.app.rundir import RunDir
from strategies.doctor import DTYPES, Diagnosis, diagnose

__all__ = ["DoctorError", "load_run", "diagnose_dir", "main"]

LR_WINDOW = 20
"""How many steps of the learning-rate schedule the doctor sees (the current one last)."""


class DoctorError(Exception):
    """A run directory the doctor cannot use; the message is one line."""


def load_run(run_dir: Path, step: int | None = None) -> dict[str, Any]:
    """Everything ``diagnose`` needs from ``run_dir``: model (weights loaded), loss function,
    batch, scaler, precision, learning-rate history, step and the config.

    Raises:
        DoctorError: the directory is missing, is no scalelab run, or its checkpoint/config is unusable.
    """
    if not run_dir.is_dir():
        raise DoctorError(f"run directory {run_dir} does not exist or is not a directory")
    path = run_dir / schema.CHECKPOINT_NAME
    if not path.exists():
        what = "a scalelab run without a checkpoint (train.checkpoint_every=0?)" if (
            run_dir / schema.SUMMARY_NAME).exists() else "not a scalelab run directory"
        raise DoctorError(f"{run_dir} is {what}: no {schema.CHECKPOINT_NAME} to rebuild the model from")
    try:
        state = ckpt.load(path)
    except ckpt.CheckpointError as exc:
        raise DoctorError(one_line(exc)) from None
    config = RunDir(run_dir).recorded_config(state)
    if config is None:
        raise DoctorError(f"{path} records no configuration: it was not written by scalelab-train")
    cfg: DictConfig = OmegaConf.create(config)
    try:
        precision, blocks = doctor_precision(build_precision(cfg))
    except (AppError, AttributeError, KeyError):
        precision, blocks = str(OmegaConf.select(cfg, "precision.name", default="?")), None
    if precision not in DTYPES:
        raise DoctorError(f"the run trained in precision {precision!r}; the doctor diagnoses {', '.join(DTYPES)} runs")
    try:
        data = build_data(cfg)
        model = build_model(cfg, data)
        model.load_state_dict(state["model"])
        scaler = build_strategy(cfg)
        scaler.load_state_dict(state["strategy"])
        run = RunConfig.from_hydra(cfg)
    except (AppError, KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise DoctorError(f"{run_dir} cannot be rebuilt from its checkpoint and configuration: {one_line(exc)[:300]}") from None
    at = int(state["step"]) if step is None else step
    if at < 1:
        raise DoctorError(f"--step must be >= 1, got {at} (the checkpoint is at step {state['step']})")
    x, y = data.batch(run.train.batch_size, step_generator(run.seed, at))
    m = run.regime.multiplier(at)
    lr_for = run.train.lr_schedule(float(cfg.optimizer.lr))
    return {
        "model": model.train(),
        "loss_fn": lambda mod, b: recipe.loss(mod(b[0]), b[1]) * m,
        "batch": (x, y),
        "scaler": scaler if scaler.is_enabled() else None,
        "scale": None if scaler.is_enabled() else 1.0,
        "precision": precision,
        "blocks": blocks,
        "lr_history": [lr_for(s) for s in range(max(1, at - LR_WINDOW + 1), at + 1)],
        "step": at,
        "config": config,
        "status": state.get("status"),
    }


def diagnose_dir(run_dir: Path, step: int | None = None, compare_strategies: bool = True,
                 forward_strategies: bool = False) -> tuple[Diagnosis, dict]:
    """Load ``run_dir`` (:func:`load_run`) and diagnose its step; returns the diagnosis and the run."""
    run = load_run(run_dir, step)
    diagnosis = diagnose(run["model"], run["loss_fn"], run["batch"], precision=run["precision"],
                         scaler=run["scaler"], scale=run["scale"], lr_history=run["lr_history"],
                         compare_strategies=compare_strategies, forward_strategies=forward_strategies,
                         blocks=run["blocks"])
    return diagnosis, run


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``scalelab-doctor``)."""
    parser = argparse.ArgumentParser(prog="scalelab-doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory written by scalelab-train")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--step", type=int, default=None, help="diagnose this step's batch (default: the checkpoint's step)")
    parser.add_argument("--no-strategies", action="store_true",
                        help="skip the per-strategy scales (saves one backward pass per strategy)")
    parser.add_argument("--all-strategies", action="store_true",
                        help="also compare the strategies that hook the forward pass (one forward+backward more each)")
    args = parser.parse_args(argv)
    try:
        diagnosis, run = diagnose_dir(args.run_dir, args.step, not args.no_strategies, args.all_strategies)
    except DoctorError as exc:
        print(f"scalelab-doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload = json.loads(diagnosis.to_json())
        payload.update(run_dir=str(args.run_dir), step=run["step"], status=run["status"])
        print(json.dumps(payload, indent=2))
    else:
        print(f"{args.run_dir} (step {run['step']}, {run['status']}, {run['precision']}, scale {diagnosis.scale:g})")
        print(diagnosis.text())
    return diagnosis.exit_code


if __name__ == "__main__":
    sys.exit(main())
