"""From config to objects: restricted ``instantiate`` and the builders the loop uses.

Every error a user can cause with an override ends as a one-line :class:`ConfigError` naming the
option, the bad value and what is allowed: the run options' from their dataclasses
(:mod:`experiments.app.config`), the groups' from the constructors :func:`safe_instantiate` calls. ``ConfigError`` derives from Hydra's
``CompactHydraException``, so Hydra prints its message alone (no traceback) and exits non-zero.

``instantiate`` builds only an explicit allow-list of objects (:func:`allowed_target`): the
strategy factory ``strategies.create``, ``torch.optim`` optimizer classes, and this project's
model, data and logger classes. A ``_target_`` is resolved to the object it names *without
importing anything* (only through modules already loaded), then compared with the list, so an
alias such as ``experiments.app.checkpoint.torch.load`` is the refused ``torch.load``, and a module
with import-time effects is never imported by a config. The ``hydra`` node, which Hydra acts on
itself (sweeper, launcher, callbacks, logging, job environment), is checked by
:mod:`experiments.app.config_safety` against allow-lists of its own.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import hydra.utils
import torch
from hydra.errors import CompactHydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf

import strategies
from experiments.workloads import data as _data
from experiments.app import loggers as _loggers
from experiments.workloads import models as _models
from experiments.workloads.heldout import HeldoutChars
from experiments.workloads.pretrained import PretrainedGPT
from experiments.workloads.rl_task import PolicyTask
from experiments.workloads.precision import Precision
from experiments.app.recipe import decay_groups

__all__ = [
    "ConfigError",
    "AppError",
    "ALLOWED_TARGETS",
    "allowed_target",
    "resolve",
    "refusal",
    "check_targets",
    "safe_instantiate",
    "build_data",
    "build_model",
    "build_optimizer",
    "keep_gradients",
    "build_strategy",
    "build_precision",
    "strategy_label",
    "run_labels",
    "instantiate_loggers",
    "one_line",
]

ALLOWED_TARGETS = (
    strategies.create,
    _models.GPT, _models.MLP, _models.CNN, PretrainedGPT,
    _data.CharData, _data.TeacherVectors, _data.TemplateImages, HeldoutChars, PolicyTask,
    _loggers.WandbLogger,
)
"""What a config may build, besides the optimizer classes of ``torch.optim``."""
DATA_SHAPE_KEYS = ("vocab_size", "block_size", "in_features", "in_channels", "num_classes")


class AppError(CompactHydraException):
    """An error Hydra reports as its one-line message (no traceback), with a non-zero exit code."""


class ConfigError(AppError, ValueError):
    """A bad configuration value: the message names the option, the value and what is allowed."""


def one_line(text: object) -> str:
    """``text`` on one line (whitespace runs, newlines included, become one space)."""
    return " ".join(str(text).split())


def resolve(target: str) -> Any:
    """The object ``target`` names, through already-loaded modules only; ``None`` when it names none.

    Judging a name runs no code of it: attributes are looked up statically
    (``inspect.getattr_static``), so neither a module's lazy ``__getattr__`` (torch's imports
    ``torch._dynamo`` on first access) nor a property runs, and nothing is imported."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: Any = module
        for name in parts[cut:]:
            obj = inspect.getattr_static(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


def allowed_target(obj: Any) -> bool:
    """True for the objects a config may build: :data:`ALLOWED_TARGETS` and ``torch.optim`` optimizers."""
    if any(obj is allowed for allowed in ALLOWED_TARGETS):
        return True
    return (
        inspect.isclass(obj)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
        and obj.__module__.startswith("torch.optim")
    )


def _allowed_names() -> str:
    by_module: dict[str, list[str]] = {}
    for obj in ALLOWED_TARGETS:
        module = "strategies" if obj is strategies.create else obj.__module__
        by_module.setdefault(module, []).append(obj.__qualname__)
    names = [f"{m}.{n[0]}" if len(n) == 1 else f"{m}.{{{','.join(n)}}}" for m, n in by_module.items()]
    return ", ".join(names[:1] + ["torch.optim.<optimizer class>"] + names[1:])


def refusal(where: str, target: str, obj: Any, allowed: str) -> ConfigError:
    """The one-line error for ``where=target`` (resolved to ``obj``, ``None``: nothing) not allowed."""
    what = "names nothing the app loads" if obj is None else (
        f"resolves to {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}")
    return ConfigError(f"{where}={target!r} is not allowed ({what}); allowed: {allowed}")


def check_targets(node: Any, path: str) -> None:
    """Refuse any ``_target_`` (at any depth) that does not resolve to an allowed object."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None:
            where = f"{path}._target_" if path else "_target_"
            if not isinstance(target, str) or not target:
                raise ConfigError(f"{where} must be a dotted name, got {target!r}")
            obj = resolve(target)
            if obj is None or not allowed_target(obj):
                raise refusal(where, target, obj, _allowed_names())
        for key, value in node.items():
            check_targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            check_targets(value, f"{path}[{i}]")


def safe_instantiate(node: DictConfig | dict, path: str, drop: Iterable[str] = (), **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after :func:`check_targets`, with ``drop`` keys removed.

    A ``ValueError``/``TypeError`` raised by the target becomes a one-line ``ConfigError``
    prefixed with ``path`` (e.g. ``strategy: growth_factor must be > 1, got 0.5``).
    """
    container = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(container, dict)
    for key in drop:
        container.pop(key, None)
    if "_target_" not in container:
        raise ConfigError(f"{path} has no _target_")
    check_targets(container, path)
    try:
        return hydra.utils.instantiate(container, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ConfigError(f"{path}: {one_line(cause)}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path}: {one_line(exc)}") from None


def build_precision(cfg: DictConfig) -> Precision:
    try:
        return Precision.from_config(OmegaConf.to_container(cfg.precision, resolve=True))  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise ConfigError(one_line(exc)) from None


def build_data(cfg: DictConfig) -> Any:
    """The dataset object from ``cfg.data`` (``name`` is a label, not a constructor argument)."""
    return safe_instantiate(cfg.data, "data", drop=("name",))


def build_model(cfg: DictConfig, data: Any) -> torch.nn.Module:
    """The model from ``cfg.model``; shape arguments it does not set come from the dataset.

    The model class's ``accepts`` names the data kinds it can train on (``text``, ``vectors``,
    ``images``); a mismatch is a ``ConfigError`` naming both choices.
    """
    node = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(node, dict)
    check_targets(node, "model")
    cls = hydra.utils.get_class(node["_target_"])
    accepts = getattr(cls, "accepts", ())
    if data.kind not in accepts:
        raise ConfigError(
            f"model={cfg.model.get('name')} cannot train on data={cfg.data.get('name')} "
            f"(data kind {data.kind!r}); it accepts data of kind: {', '.join(accepts)}"
        )
    params = inspect.signature(cls).parameters
    extra = {k: getattr(data, k) for k in DATA_SHAPE_KEYS if hasattr(data, k) and k in params and k not in node}
    return safe_instantiate(node, "model", drop=("name",), **extra)


def build_optimizer(cfg: DictConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer from ``cfg.optimizer``; a positive ``weight_decay`` applies to matrices only
    (nanoGPT's groups, :func:`experiments.app.recipe.decay_groups`). ``train.zero_grad: false`` makes
    its ``zero_grad()`` a no-op (:func:`keep_gradients`: a loop bug on purpose)."""
    params = list(params)
    wd = OmegaConf.select(cfg, "optimizer.weight_decay", default=None)
    groups = decay_groups(params, float(wd)) if isinstance(wd, (int, float)) and wd > 0 else params
    opt = safe_instantiate(cfg.optimizer, "optimizer", params=groups, _convert_="all")  # groups as dicts
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optimizer._target_ must build a torch.optim.Optimizer, got {type(opt).__name__}")
    if OmegaConf.select(cfg, "train.zero_grad") is False:
        keep_gradients(opt)
    return opt


def _no_zero_grad(set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad`` that clears nothing (see :func:`keep_gradients`)."""


def keep_gradients(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The "gradients not cleared" workload (``train.zero_grad: false``): ``opt.zero_grad()``
    does nothing, as in a loop that forgot to call it, so every backward adds to ``.grad``.

    With a loss scaler, ``unscale_`` divides the whole ``.grad`` by ``S`` each step, so the clean
    part accumulates as ``g_t + g_{t-1}/S + ...``; but once one step overflows, its inf/NaN stays
    in ``.grad`` (inf + x = inf): every later step is non-finite, skipped, and the scale halves
    down to its floor — fairseq's "Minimum loss scale reached" / DeepSpeed's "Current loss scale
    already at minimum" with no cause given, the complaint of issue 21. The missing
    ``optimizer.zero_grad()`` is the commonest PyTorch training-loop bug (the PyTorch tutorials'
    "Zeroing out gradients in PyTorch" recipe; the AMP examples call it every iteration).
    """
    opt.zero_grad = _no_zero_grad  # type: ignore[method-assign]  # instance attribute: this optimizer only
    return opt


def build_strategy(cfg: DictConfig) -> Any:
    """The strategy from ``cfg.strategy`` (flat: ``_target_: strategies.create``, ``name``, keywords)."""
    strategy = safe_instantiate(cfg.strategy, "strategy", _convert_="all")  # lists as lists, not ListConfig
    for method in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict"):
        if not callable(getattr(strategy, method, None)):
            raise ConfigError(f"strategy._target_ must build a GradScaler-compatible object (no {method}())")
    return strategy


def strategy_label(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> str:
    """The run's strategy for records: ``none`` when scaling is off, else the ``strategy`` config
    option chosen (``choices``: Hydra's ``runtime.choices``; a preset such as ``megatron`` is
    ``native`` with other defaults, and must not be recorded as ``native``), else the registered name."""
    if OmegaConf.select(cfg, "strategy.enabled") is False:
        return "none"
    chosen = (choices or {}).get("strategy")
    return str(chosen) if isinstance(chosen, str) and chosen else str(OmegaConf.select(cfg, "strategy.name", default="unknown"))


def run_labels(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The labels a run record carries: strategy, precision, model, data, regime and workload."""
    names = {
        "strategy": strategy_label(cfg, choices),
        "precision": str(cfg.precision.name),
        "model": str(cfg.model.get("name", "model")),
        "data": str(cfg.data.get("name", "data")),
        "regime": str(cfg.regime.name),
    }
    names["workload"] = f"{names['model']}/{names['data']}/{names['regime']}"
    return names


def instantiate_loggers(logger_cfg: DictConfig | dict, run: _loggers.RunInfo) -> list[_loggers.Logger]:
    """Every ``_target_`` entry of ``logger_cfg`` built with ``run=run`` (entries without one are skipped)."""
    loggers: list[_loggers.Logger] = []
    for key, node in (logger_cfg or {}).items():
        if not isinstance(node, (dict, DictConfig)):
            raise ConfigError(f"logger.{key} must be a logger config with a _target_, got {node!r}")
        if "_target_" in node:
            # A partial, then the run: the run's config must never pass through instantiate itself
            # (it holds the other groups' _target_s).
            make = safe_instantiate(node, f"logger.{key}", _convert_="all", _partial_=True)
            try:
                logger = make(run=run)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"logger.{key}: {one_line(exc)}") from None
            if not all(callable(getattr(logger, m, None)) for m in ("log", "finish")):
                raise ConfigError(f"logger.{key}._target_ must build a logger (log() and finish()), got {type(logger).__name__}")
            loggers.append(logger)
    return loggers
