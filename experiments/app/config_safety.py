"""What a command line may not do through the ``hydra`` node: run code, load code, or steer programs.

Threat model (``docs/guarantees.md``): the installed code and the ``conf/`` tree are trusted; the
command line's overrides are not. :mod:`experiments.app.build` allow-lists the ``_target_`` of the
app's own groups; this module checks the rest of the composed config — the ``hydra`` node, which
Hydra itself acts on before the app runs:

* ``hydra.sweeper``, ``hydra.launcher`` and ``hydra.callbacks.<name>`` are instantiated by Hydra.
  Each ``_target_`` is resolved to the object it names (through modules already loaded, never by
  importing the name, see :func:`experiments.app.build.resolve`) and compared by identity with the
  objects of :data:`HYDRA_TARGETS` for that place. A ``_target_`` anywhere else under ``hydra``
  (e.g. nested inside the launcher's options, which Hydra instantiates recursively) is refused.
* ``hydra.job_logging`` and ``hydra.hydra_logging`` go to :func:`logging.config.dictConfig`,
  which builds any callable named by a ``()`` or ``class`` key and imports any module named by an
  ``ext://`` value: those must be in :data:`LOGGING_OBJECTS` / :data:`LOGGING_EXT`, and every log
  file must lie inside the run's output directory.
* ``hydra.job.env_set`` / ``hydra.job.env_copy`` set environment variables for the job and every
  program it starts (the run's ``git`` fingerprint, the kernel compiler, launcher subprocesses):
  only the variables of :data:`ENV_ALLOWED` — thread counts, visible devices, allocator and
  determinism switches, W&B's run labels — may be set. Anything that chooses code, paths,
  programs or configuration (``GIT_*``, ``LD_*``, ``PYTHON*``, ``PATH``, ``HOME``, ``CXX``,
  ``TORCH_EXTENSIONS_DIR``, ``BASH_ENV``, ...) is refused, because an allow-list cannot miss one.
* ``hydra.output_subdir`` must stay inside the output directory; the SLURM launcher's shell
  lines (``setup``, ``srun_args``, ``additional_parameters``) may come only from a trusted
  ``conf/hydra/launcher/*.yaml``, never from an override; another config tree from the command
  line (``--config-dir``, ``--config-path``, ``hydra.searchpath``: Hydra reads its files, and
  imports the package of a ``pkg://`` search path, while composing, before any check) and
  ``--experimental-rerun`` (which unpickles a file) are refused.

Every refusal is a one-line :class:`experiments.app.build.ConfigError` naming the key.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from experiments.app.build import ConfigError, check_targets, one_line, refusal, resolve

__all__ = [
    "HYDRA_TARGETS",
    "LOGGING_OBJECTS",
    "LOGGING_EXT",
    "ENV_ALLOWED",
    "LAUNCHER_SHELL_KEYS",
    "allowed_objects",
    "check_config",
    "check_command_line",
    "check_env_name",
]

HYDRA_TARGETS: dict[str, tuple[str, ...]] = {
    "hydra.sweeper": (
        "hydra_plugins.scalelab_sweeper.GridSweeper",
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
    ),
    "hydra.launcher": (
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    ),
    "hydra.callbacks.*": ("experiments.app.progress.SweepProgress",),
}
"""Per place in the ``hydra`` node, the objects Hydra may build there (``module.name``)."""

LOGGING_OBJECTS = (
    "logging.StreamHandler", "logging.FileHandler", "logging.NullHandler", "logging.Formatter",
    "colorlog.ColoredFormatter",  # hydra_colorlog's formatter, when that plugin is installed
)
"""What a ``()`` or ``class`` key of a logging configuration may name."""

LOGGING_EXT = ("sys.stdout", "sys.stderr")
"""What an ``ext://`` value of a logging configuration may name."""

ENV_ALLOWED = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG",
    "PYTORCH_CUDA_ALLOC_CONF", "TORCH_SHOW_CPP_STACKTRACES", "TOKENIZERS_PARALLELISM",
    "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NOTES",
    "WANDB_SILENT", "WANDB_CONSOLE",
)
"""The environment variables ``hydra.job.env_set`` / ``env_copy`` may set: numbers, devices and
labels, none of which names a program, a library, a path or a configuration file."""

LAUNCHER_SHELL_KEYS = ("setup", "srun_args", "additional_parameters")
"""hydra-submitit-launcher keys whose values become shell lines or ``sbatch`` options."""

ACTED_ON = ("sweeper", "launcher", "callbacks", "job_logging", "hydra_logging", "job", "output_subdir")
"""The keys of the ``hydra`` node that Hydra builds or applies (they must resolve to be checked)."""


def allowed_objects(names: tuple[str, ...]) -> list[Any]:
    """The objects ``names`` (``module.attr``) denote, importing each trusted module; missing
    optional plugins are skipped."""
    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return found


def _place(path: str) -> str | None:
    """The :data:`HYDRA_TARGETS` key of the node at ``path``, or ``None`` (no target allowed)."""
    for place in HYDRA_TARGETS:
        if fnmatch.fnmatchcase(path, place) and path.count(".") == place.count("."):
            return place
    return None


def _check_target(target: Any, where: str, names: tuple[str, ...]) -> None:
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{where} must be a dotted name, got {target!r}")
    allowed = allowed_objects(names)
    obj = resolve(target)
    if obj is None or not any(obj is a for a in allowed):
        raise refusal(where, target, obj, ", ".join(names) if names else "none (no _target_ may appear here)")


def _walk_targets(node: Any, path: str) -> None:
    """Every ``_target_`` under the ``hydra`` node ``node`` (at ``path``) is allowed for its place."""
    if isinstance(node, dict):
        if "_target_" in node:
            place = _place(path)
            _check_target(node["_target_"], f"{path}._target_", HYDRA_TARGETS[place] if place else ())
        for key, value in node.items():
            _walk_targets(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk_targets(value, f"{path}[{i}]")


def _walk_logging(node: Any, path: str, output_dir: str) -> None:
    """``()``/``class`` keys name :data:`LOGGING_OBJECTS`, ``ext://`` values :data:`LOGGING_EXT`,
    and every ``filename`` lies inside ``output_dir``."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}"
            if key in ("()", "class"):
                _check_target(value, where, LOGGING_OBJECTS)
            elif key == "filename":
                inside = os.path.normpath(os.path.join(output_dir, str(value)))
                if os.path.commonpath([inside, os.path.normpath(output_dir)]) != os.path.normpath(output_dir):
                    raise ConfigError(f"{where}={value!r} is not allowed: log files go inside the run's output directory")
            _walk_logging(value, where, output_dir)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk_logging(value, f"{path}[{i}]", output_dir)
    elif isinstance(node, str) and node.startswith("ext://") and node[len("ext://"):] not in LOGGING_EXT:
        raise ConfigError(f"{path}={node!r} is not allowed; allowed ext:// values: {', '.join(LOGGING_EXT)}")


def check_env_name(name: Any, where: str) -> None:
    """Refuse an environment variable name that is not in :data:`ENV_ALLOWED`."""
    if name not in ENV_ALLOWED:
        raise ConfigError(
            f"{where}: setting {name!r} for the job is not allowed (it could change which programs, libraries "
            f"or settings the job and its subprocesses use); allowed: {', '.join(ENV_ALLOWED)}"
        )


def _as_in_job(cfg: DictConfig, output_dir: str | None, job_num: int) -> DictConfig:
    """A copy of ``cfg`` with what Hydra sets before a job runs: job number and id, and the output
    directory (``output_dir``; ``None``: a sweep job's, ``hydra.sweep.dir``/``hydra.sweep.subdir``)."""
    cfg = cfg.copy()
    with read_write(cfg), open_dict(cfg):
        for key, value in (("num", job_num), ("id", f"preflight_{job_num}")):
            if OmegaConf.is_missing(cfg.hydra.job, key):
                cfg.hydra.job[key] = value
        if output_dir is None:
            with _hydra_context(cfg):
                try:
                    output_dir = os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir))
                except Exception as exc:  # noqa: BLE001 - Hydra would fail the same way
                    raise ConfigError(f"hydra.sweep does not resolve: {one_line(exc)[:300]}") from None
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):  # as Hydra's run_job sets it
        cfg.hydra.runtime.output_dir = os.path.abspath(output_dir)
    return cfg


@contextmanager
def _hydra_context(cfg: DictConfig) -> Iterator[None]:
    """``${hydra:...}`` resolves against ``cfg`` (as inside Hydra's job); restored afterwards."""
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = saved


def _check_hydra_node(job: DictConfig) -> None:
    """Check the ``hydra`` node of ``job`` (from :func:`_as_in_job`, inside :func:`_hydra_context`)
    as Hydra will use it: instantiated targets, logging, environment and ``output_subdir``."""
    nodes: dict[str, Any] = {}
    for key in job.hydra:
        value = job.hydra._get_node(key)
        try:
            nodes[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else job.hydra[key]
        except Exception as exc:  # noqa: BLE001 - any resolution failure: Hydra would fail the same way
            if key in ACTED_ON:
                raise ConfigError(f"hydra.{key} does not resolve: {one_line(exc)[:300]}") from None
            nodes[key] = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else None
    for key, node in nodes.items():
        _walk_targets(node, f"hydra.{key}")
    for key in ("job_logging", "hydra_logging"):
        _walk_logging(nodes[key], f"hydra.{key}", str(job.hydra.runtime.output_dir))
    for name in (nodes["job"].get("env_set") or {}):
        check_env_name(name, f"hydra.job.env_set.{name}")
    for name in (nodes["job"].get("env_copy") or []):
        check_env_name(name, "hydra.job.env_copy")
    sub = nodes["output_subdir"]
    if sub is not None and (os.path.isabs(str(sub)) or ".." in str(sub).replace("\\", "/").split("/")):
        raise ConfigError(f"hydra.output_subdir={sub!r} is not allowed: it must be a relative path inside the output directory")


def _is_under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".") or prefix.startswith(key + ".")


TREE_HINT = "the config tree is the environment's choice: set SCALELAB_CONF_DIR to a copy of conf/ instead"


def check_command_line(overrides: list[str], config_path: str | None, config_dir: str | None, rerun: str | None) -> None:
    """Refusals that must come before Hydra composes anything: ``--experimental-rerun`` (unpickles
    a file); another config tree (``--config-path``, ``--config-dir``, ``hydra.searchpath``: its
    files are composed before any check, and a ``pkg://`` search path in them imports a package);
    overrides of the launcher's shell keys (:data:`LAUNCHER_SHELL_KEYS`)."""
    if rerun is not None:
        raise ConfigError("--experimental-rerun is not allowed: it unpickles a file, which can run any code")
    for flag, value in (("--config-path", config_path), ("--config-dir", config_dir)):
        if value is not None:
            raise ConfigError(f"{flag}={value!r} is not allowed: {TREE_HINT}")
    parser = OverridesParser.create()
    for arg in overrides:
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException:
            continue  # train.check_overrides reports malformed overrides
        key = override.key_or_group.lstrip("+~")
        if _is_under(key, "hydra.searchpath"):
            raise ConfigError(f"{arg!r} is not allowed: {TREE_HINT}")
        for shell_key in LAUNCHER_SHELL_KEYS:
            if _is_under(key, f"hydra.launcher.{shell_key}"):
                raise ConfigError(
                    f"{arg!r} is not allowed: hydra.launcher.{shell_key} becomes shell commands of the job; "
                    "set it in a conf/hydra/launcher/*.yaml file instead"
                )


def check_config(cfg: DictConfig, output_dir: str | None = None, job_num: int = 0) -> None:
    """Check a composed config (``return_hydra_config=True``) as Hydra will use it in job
    ``job_num`` writing to ``output_dir`` (``None``: the sweep job's directory): its ``hydra``
    node, then every ``_target_`` of the app's part against :func:`experiments.app.build.allowed_target`
    (resolved as in the job when it resolves; a value that does not resolve is refused by the
    job's own :meth:`experiments.app.config.RunConfig.from_hydra` before anything is built). Raises a one-line
    :class:`ConfigError`."""
    job = _as_in_job(cfg, output_dir, job_num)
    app: dict[str, Any] = {}
    with _hydra_context(job):
        _check_hydra_node(job)
        for key in job:
            if key != "hydra":
                try:
                    app[str(key)] = OmegaConf.to_container(job[key], resolve=True) if OmegaConf.is_config(job[key]) else job[key]
                except Exception:  # noqa: BLE001 - see the docstring
                    app[str(key)] = OmegaConf.to_container(job._get_node(key), resolve=False) if OmegaConf.is_config(job._get_node(key)) else None
    check_targets(app, "")
