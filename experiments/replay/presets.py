"""A strategy option by name, built as the app builds it: a preset (``conf/strategy/<name>.yaml``,
composed with the run's precision, so ``underflow_target``'s ``${precision.max}`` resolves) or a
registered rule without a YAML (a plugin), with ``--set key=value`` overrides."""

from __future__ import annotations

from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import strategies
from experiments.app.build import build_strategy, one_line
from experiments.app.train import CONF_DIR, group_options

__all__ = ["PresetError", "build", "options", "parse_sets"]


class PresetError(ValueError):
    """An unknown strategy or a bad ``--set`` (one line)."""


def options() -> list[str]:
    """Every strategy option that scales: the presets of ``conf/strategy/`` (``none`` left out)."""
    return [o for o in group_options("strategy") if o != "none"]


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` as a dict, each value read as YAML (``1e-4``, ``true``, ``[a, b]``)."""
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not key.replace("_", "a").isalnum():
            raise PresetError(f"bad --set {item!r}: expected key=value (a strategy option, e.g. min_scale=1)")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise PresetError(f"bad --set {item!r}: {one_line(exc)}") from None
    return out


def _compose(overrides: list[str]) -> Any:
    if GlobalHydra.instance().is_initialized():  # inside a Hydra job: its own search path
        return compose("config", overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def build(name: str, precision: str = "fp16", sets: list[str] | None = None) -> strategies.Strategy:
    """The strategy option ``name`` with ``sets`` applied (module docstring). Raises
    :class:`PresetError` for an unknown name, a bad ``--set`` or values its ``Params`` refuse."""
    values = parse_sets(list(sets or []))
    if name in options():
        overrides = [f"strategy={name}", f"precision={precision}", "logger=none",
                     *(f"strategy.{k}={OmegaConf.to_yaml(v).strip() if isinstance(v, (list, dict)) else _scalar(v)}"
                       for k, v in values.items())]
        try:
            return build_strategy(_compose(overrides))
        except Exception as exc:  # noqa: BLE001 - Hydra's and the Params' errors, as one line
            unknown = [k for k in values if f"'strategy.{k}'" in str(exc)]
            if unknown:
                keys = sorted(k for k in _compose([f"strategy={name}", f"precision={precision}"]).strategy
                              if k not in ("_target_", "name"))
                raise PresetError(f"{name} has no option {unknown[0]!r}; its options: {', '.join(keys)}") from None
            raise PresetError(f"{name}: {one_line(exc)}"[:400]) from None
    if name in strategies.available() and name != "none":
        try:
            return strategies.create(name, **values)
        except (TypeError, ValueError) as exc:
            raise PresetError(f"{name}: {one_line(exc)}") from None
    known = sorted(set(options()) | set(strategies.available()))
    raise PresetError(f"unknown strategy {name!r}; available: {', '.join(known)}")


def _scalar(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
