"""``scalelab-train``: the Hydra app that trains one configuration and writes its run record.

    scalelab-train strategy=max_ema precision=fp16 regime=small_grad seed=1
    scalelab-train -m strategy=glob(*) seed=0,1,2             # a sweep (basic launcher)
    python -m experiments.app.train logger=none train.steps=20    # same thing without the script

Config tree: ``conf/config.yaml`` (groups ``model``, ``data``, ``precision``, ``strategy``,
``regime``, ``logger``): ``$SCALELAB_CONF_DIR`` if set (e.g. an edited copy), else the copy an
installed wheel ships as ``experiments/conf``, else ``<checkout>/conf``. Everything a run writes goes under ``${hydra:runtime.output_dir}``
(``hydra.job.chdir=False``: the working directory is never changed). Re-running with the same
``hydra.run.dir=...`` resumes from that directory's checkpoint.

Before Hydra starts, :func:`main` checks the command-line overrides: a malformed override or an
unknown choice for one of this project's config groups ends with one line naming the option and
the allowed values, and exit code 2 (Hydra's own messages for these span several lines). Then
:func:`check_safety` composes the config exactly as Hydra will (its flags, search path and mode; a
sweep's master config and a covering sample of its jobs) and refuses, the same way, anything that
would make Hydra run code or steer a program — a ``_target_``, logging factory or job environment
variable off its allow-list, the ``hydra`` node included (:mod:`experiments.app.config_safety`) — before
Hydra builds a callback, sweeper or launcher or writes anything. For a single run,
:func:`preflight` then composes the config as Hydra will and validates it (values,
``_target_`` allow-list, the output directory) before Hydra creates or writes anything. A bad
value found while building the run (out of range, a model that cannot take the data, an unusable
checkpoint, a directory holding another run or in use) ends the same way in a single run; in a
sweep the job fails with that one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import (
    create_automatic_config_search_path,
    detect_calling_file_or_module_from_task_function,
    detect_task_name,
    get_args_parser,
)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.app.build import AppError, one_line
from experiments.app.config import RunConfig
from experiments.app.config_safety import check_command_line, check_config
from experiments.app.log_lines import result_line
from experiments.app.loop import run
from experiments.app.rundir import RunDir
from hydra_plugins.scalelab_sweeper import covering

__all__ = ["main", "check_overrides", "check_safety", "preflight", "group_options", "CONF_DIR", "GROUPS"]


def _conf_dir() -> Path:
    """``SCALELAB_CONF_DIR``, else the copy an installed wheel ships (``experiments/conf``), else
    ``<checkout>/conf``."""
    env = os.environ.get("SCALELAB_CONF_DIR")
    if env:
        return Path(env).resolve()
    package = Path(__file__).resolve().parents[1]  # experiments/
    return package / "conf" if (package / "conf").is_dir() else package.parent / "conf"


CONF_DIR = _conf_dir()
GROUPS = ("model", "data", "precision", "strategy", "regime", "logger")


def group_options(group: str) -> list[str]:
    """The option names of a config group: the ``*.yaml`` files in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_overrides(args: list[str]) -> str | None:
    """Return a one-line error for the first bad override in ``args``, or ``None`` if all are fine.

    Checks the override grammar (Hydra's parser) and, for this project's config groups, that each
    chosen option exists (sweeps ``a,b`` and ``choice(...)`` are checked element-wise; ``glob``
    and interpolations are left to Hydra).
    """
    candidates = [a for a in args if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    parser = OverridesParser.create()
    for arg in candidates:
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException as exc:
            detail = " ".join(str(exc).split("\n")[1:2]) or str(exc).split("\n")[0]
            return f"malformed override {arg!r}: {detail.strip()} (see https://hydra.cc/docs/advanced/override_grammar/basic/)"
        key = override.key_or_group.lstrip("+~")
        if key not in GROUPS or override.is_delete():
            continue
        value = override.value()
        if isinstance(value, ChoiceSweep):
            chosen = list(value.list)
        elif isinstance(value, list) and override.is_sweep_override():
            chosen = value
        elif isinstance(value, str):
            chosen = [value]
        else:
            continue
        allowed = group_options(key)
        for choice in chosen:
            if isinstance(choice, str) and choice not in allowed:
                return f"unknown {key} {choice!r}; allowed values for {key}: {', '.join(allowed)}"
    return None


# An absolute config path: the app is found the same way as a script, as `python -m`, and as the
# console script (Hydra resolves a relative path against the calling module, which differs).
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _app(cfg: DictConfig) -> float | None:
    """Hydra task: train one configuration; the return value (final eval loss) serves sweepers."""
    hc = HydraConfig.get()
    try:
        summary = run(cfg, hc.runtime.output_dir, list(hc.overrides.task), dict(hc.runtime.choices))
    except AppError as exc:
        if hc.mode == RunMode.RUN:
            # One run: the one-line message is the whole report (no "HYDRA_FULL_ERROR" banner).
            print(f"scalelab-train: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise  # a sweep: Hydra records this job as failed with the same one-line message
    if hc.mode == RunMode.RUN and os.environ.get("RANK", "0") == "0":  # a sweep prints one line per job itself
        print(f"scalelab-train: {result_line(summary)} -> {hc.runtime.output_dir}", file=sys.stderr, flush=True)
    return summary.get("final_eval_loss")


def _hydra_args(args: list[str]) -> argparse.Namespace | None:
    """``args`` parsed by Hydra's own command-line parser; ``None`` when it rejects them (Hydra then
    prints its usage error itself)."""
    try:
        return get_args_parser().parse_args(args)
    except SystemExit:
        return None


def _main_hydra() -> Any:
    """Hydra's main object, built as ``hydra.main`` builds it for :func:`_app` (same search path and
    task name), so composing with it gives the config Hydra will run. (``--config-path`` and
    ``--config-dir`` are refused before: :func:`experiments.app.config_safety.check_command_line`.)"""
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(_app)
    search_path = create_automatic_config_search_path(calling_file, calling_module, str(CONF_DIR))
    return Hydra.create_main_hydra2(task_name=detect_task_name(calling_file, calling_module), config_search_path=search_path)


def _check_sweep(hydra: Any, master: DictConfig) -> None:
    """The master config of a sweep and a covering sample of its jobs (every ``key=value`` of the
    sweep in at least one; the sweeper's own :func:`hydra_plugins.scalelab_sweeper.covering`),
    each composed as the launcher will compose it, pass :func:`experiments.app.config_safety.check_config`."""
    sweep_dir = str(master.hydra.sweep.dir)
    check_config(master, sweep_dir)
    params = OmegaConf.select(master, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(master.hydra.overrides.task)
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(arguments)
    (jobs,) = BasicSweeper.split_arguments(parsed, None)
    for num, job in enumerate(covering(jobs)):
        try:
            job_cfg = hydra.config_loader.load_sweep_config(master, list(job))
        except Exception:  # noqa: BLE001 - a job that does not compose never runs; the sweeper reports it
            continue
        check_config(job_cfg, None, num)


def check_safety(args: list[str]) -> str | None:
    """A one-line error when the command line would make Hydra run code or steer programs
    (:mod:`experiments.app.config_safety`), checked on the config Hydra will compose — a single run, or
    a sweep's master config and a covering sample of its jobs — before Hydra builds a callback,
    sweeper or launcher, configures logging, sets a job's environment or writes anything; else ``None``."""
    ns = _hydra_args(args)
    if ns is None:
        return None
    try:
        check_command_line(ns.overrides, ns.config_path, ns.config_dir, ns.experimental_rerun)
        hydra = _main_hydra()
        try:
            config_name = ns.config_name or "config"
            multirun = ns.multirun or (hydra.get_mode(config_name, ns.overrides) == RunMode.MULTIRUN and not ns.run)
            mode = RunMode.MULTIRUN if multirun else RunMode.RUN
            try:
                cfg = hydra.compose_config(config_name, list(ns.overrides), run_mode=mode, with_log_configuration=False)
            except Exception:  # noqa: BLE001 - Hydra reports a config that does not compose (nothing runs)
                return None
            if multirun:
                _check_sweep(hydra, cfg)
            else:
                check_config(cfg, str(cfg.hydra.run.dir))
        finally:
            GlobalHydra.instance().clear()
    except AppError as exc:
        return str(exc)
    return None


def preflight(args: list[str]) -> str | None:
    """For a single run (no ``-``/``--`` flags): a one-line error for a config that does not compose,
    does not validate, or names an unusable output directory — found before Hydra creates that
    directory or writes anything — or ``None``."""
    if any(a.startswith("-") for a in args):
        return None  # --multirun, --cfg, --help, ...: Hydra's own paths (each job is checked in run())
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=args, return_hydra_config=True)
        run_dir = Path(str(cfg.hydra.run.dir))
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors span several lines
        return one_line(exc)[:500]
    with open_dict(cfg):
        del cfg["hydra"]
    if "${hydra:" in OmegaConf.to_yaml(cfg):
        return None  # resolves only inside Hydra's job (e.g. ${hydra:runtime.output_dir}): run() checks it
    try:
        RunConfig.from_hydra(cfg)
        RunDir.check_path(run_dir.resolve())
        # Before Hydra rewrites .hydra/ of a run in progress or of another run (run() checks again).
        rundir = RunDir(run_dir.resolve())
        rundir.check_free()
        rundir.resume_plan(OmegaConf.to_container(cfg, resolve=True), cfg.train.resume, cfg.train.steps).check()  # type: ignore[arg-type]
    except AppError as exc:  # ConfigError included
        return str(exc)
    return None


def main() -> None:
    """Console entry point (``scalelab-train``)."""
    error = check_overrides(sys.argv[1:]) or check_safety(sys.argv[1:]) or preflight(sys.argv[1:])
    if error is not None:
        print(f"scalelab-train: error: {error}", file=sys.stderr)
        raise SystemExit(2)
    _app()


if __name__ == "__main__":
    main()
