"""From config to objects: validation, restricted ``instantiate``, and the builders the loop uses.

Every error a user can cause with an override ends here as a one-line :class:`ConfigError`
naming the option, the bad value and what is allowed. ``ConfigError`` derives from Hydra's
``CompactHydraException``, so Hydra prints its message alone (no traceback) and exits non-zero.

``instantiate`` only builds targets from this project's packages (``experiments.``,
``strategies.``) and *classes* from ``torch.`` (so ``torch.optim.AdamW`` is fine but
``torch.load`` or ``torch.hub.load`` — functions that can run foreign code — are refused).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import hydra.utils
import torch
from hydra.errors import CompactHydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf

from experiments.precision import Precision

__all__ = [
    "ConfigError",
    "AppError",
    "PROJECT_PREFIXES",
    "check_targets",
    "safe_instantiate",
    "validate",
    "build_data",
    "build_model",
    "build_optimizer",
    "build_strategy",
    "build_precision",
    "strategy_label",
]

PROJECT_PREFIXES = ("experiments.", "strategies.")
TORCH_PREFIX = "torch."
DATA_SHAPE_KEYS = ("vocab_size", "block_size", "in_features", "in_channels", "num_classes")


class AppError(CompactHydraException):
    """An error Hydra reports as its one-line message (no traceback), with a non-zero exit code."""


class ConfigError(AppError, ValueError):
    """A bad configuration value: the message names the option, the value and what is allowed."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_targets(node: Any, path: str) -> None:
    """Refuse any ``_target_`` (at any depth) outside the project's packages and torch's classes."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None:
            where = f"{path}._target_" if path else "_target_"
            if not isinstance(target, str):
                raise ConfigError(f"{where} must be a dotted name, got {target!r}")
            if target.startswith(TORCH_PREFIX):
                try:
                    obj = hydra.utils.get_object(target)
                except Exception:  # noqa: BLE001
                    raise ConfigError(f"{where}={target!r} does not exist in torch") from None
                if not inspect.isclass(obj):
                    raise ConfigError(
                        f"{where}={target!r} is not allowed: from torch only classes may be instantiated"
                    )
            elif not target.startswith(PROJECT_PREFIXES):
                raise ConfigError(
                    f"{where}={target!r} is not allowed: targets must be in experiments., strategies. "
                    "or be a torch class"
                )
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
        raise ConfigError(f"{path}: {_one_line(cause)}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}") from None


def _int(cfg: DictConfig, key: str, low: int, note: str = "") -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} must be an integer >= {low}{note}, got {value!r}")
    return value


def _float(cfg: DictConfig, key: str, low: float, high: float, low_open: bool = False) -> float:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ConfigError(f"{key} must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def validate(cfg: DictConfig) -> None:
    """Check the run-level options (``train.*``, ``regime.*``, ``seed``); raise ``ConfigError``."""
    for group in ("model", "data", "precision", "strategy", "regime", "logger", "train", "optimizer"):
        if not isinstance(cfg.get(group), DictConfig):
            raise ConfigError(f"config group {group!r} is missing or not a mapping")
    _int(cfg, "seed", 0)
    threads = cfg.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be null or an integer >= 1, got {threads!r}")
    steps = _int(cfg, "train.steps", 1)
    _int(cfg, "train.batch_size", 1)
    _int(cfg, "train.log_every", 1)
    _int(cfg, "train.hist_every", 0, " (0 = off)")
    _int(cfg, "train.eval_every", 0, " (0 = only at the end)")
    _int(cfg, "train.eval_batches", 1)
    _int(cfg, "train.checkpoint_every", 0, " (0 = never)")
    _int(cfg, "train.warmup", 0)
    _float(cfg, "train.grad_clip", 0.0, float("inf"))
    _float(cfg, "train.divergence_loss", 0.0, float("inf"), low_open=True)
    _float(cfg, "regime.loss_multiplier", 1e-12, 1e6)
    _float(cfg, "regime.spike_factor", 0.0, 1e12, low_open=True)
    spikes = OmegaConf.select(cfg, "regime.spike_steps")
    if spikes is None or not all(isinstance(s, int) and 1 <= s <= steps for s in spikes):
        raise ConfigError(f"regime.spike_steps must be a list of steps in [1, train.steps={steps}], got {spikes}")
    kill = OmegaConf.select(cfg, "train.kill_at_step")
    if kill is not None and (not isinstance(kill, int) or kill < 1):
        raise ConfigError(f"train.kill_at_step must be null or an integer >= 1, got {kill!r}")
    logger = OmegaConf.select(cfg, "logger.name")
    if logger not in ("wandb", "none"):
        raise ConfigError(f"logger.name must be wandb or none, got {logger!r}")
    if logger == "wandb" and OmegaConf.select(cfg, "logger.mode") not in ("online", "offline", "disabled"):
        raise ConfigError(f"logger.mode must be online, offline or disabled, got {OmegaConf.select(cfg, 'logger.mode')!r}")


def build_precision(cfg: DictConfig) -> Precision:
    try:
        return Precision.from_config(OmegaConf.to_container(cfg.precision, resolve=True))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(_one_line(exc)) from None


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
    opt = safe_instantiate(cfg.optimizer, "optimizer", params=list(params))
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optimizer._target_ must build a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


def build_strategy(cfg: DictConfig) -> Any:
    """The strategy from ``cfg.strategy`` (flat: ``_target_: strategies.create``, ``name``, keywords)."""
    strategy = safe_instantiate(cfg.strategy, "strategy")
    for method in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict"):
        if not callable(getattr(strategy, method, None)):
            raise ConfigError(f"strategy._target_ must build a GradScaler-compatible object (no {method}())")
    return strategy


def strategy_label(cfg: DictConfig) -> str:
    """The run's strategy name for records: the registered name, or ``none`` when scaling is off."""
    if OmegaConf.select(cfg, "strategy.enabled", default=True) is False:
        return "none"
    return str(OmegaConf.select(cfg, "strategy.name", default="unknown"))
