"""One home per default (issue 28): the keys and defaults of a strategy's config node are its
``Params``', those of the run options ``RunConfig``'s (``scalelab_schema/*``,
``experiments/app/config_store.py``); a YAML states only what differs, and every key stays
overridable on the command line without ``+`` — for every registered strategy, a preset, a
regime, and a strategy registered after import (as an entry-point plugin is)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import strategies
from experiments.app import config_store
from experiments.app.build import ConfigError, build_strategy
from experiments.app.config import RegimeConfig, RunConfig
from experiments.app.train import CONF_DIR, group_options
from strategies import registry
from strategies import validation as v
from strategies.params import ScalerParams, defaults, hp
from strategies.rules.native import NativeStrategy
from tests.experiments.runs import compose_cfg


def _value(x: Any) -> str:
    """``x`` in Hydra's override grammar."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_value(i) for i in x) + "]"
    return repr(x) if isinstance(x, float) else str(x)


@pytest.mark.filterwarnings("ignore::UserWarning")  # norm_ratio/hybrid without a reference closure
@pytest.mark.parametrize("option", group_options("strategy"))
def test_every_key_of_every_strategy_option_is_overridable_without_plus(option: str) -> None:
    """Every ``Params`` field, the ones the YAML does not state included, set on the command line
    (to its default, so the YAML's own values are overridden too) lands in the node and the build."""
    name = compose_cfg(f"strategy={option}").strategy.name
    fields = defaults(strategies.get(name).Params)
    stated = OmegaConf.load(CONF_DIR / "strategy" / f"{option}.yaml")
    assert set(stated) - {"defaults"} < set(fields)  # a strict subset: the YAML carries only what differs
    cfg = compose_cfg(f"strategy={option}", *(f"strategy.{k}={_value(x)}" for k, x in fields.items()))
    assert OmegaConf.to_container(cfg.strategy) == config_store.strategy_node(name)
    assert build_strategy(cfg).params == strategies.get(name).Params()


@pytest.mark.parametrize("name", strategies.available())
def test_each_registered_strategy_has_a_schema_node_from_its_params(name: str) -> None:
    node = config_store.strategy_node(name)
    assert node["_target_"] == "strategies.create" and node["name"] == name
    assert list(node)[2:] == [f.name for f in dataclasses.fields(strategies.get(name).Params)]


def test_a_type_error_in_an_override_is_still_one_line() -> None:
    cfg = compose_cfg("strategy=megatron", "strategy.track_stats=maybe")
    with pytest.raises(ConfigError, match=r"^strategy: track_stats must be a bool, got 'maybe'$"):
        build_strategy(cfg)


@pytest.mark.parametrize("option", group_options("regime"))
def test_every_regime_key_is_overridable_and_defaults_come_from_the_dataclass(option: str) -> None:
    cfg = compose_cfg(f"regime={option}", "regime.rescale_grads=false", "regime.spike_factor=2.0")
    regime = RunConfig.from_hydra(cfg).regime
    assert regime.name == option and not regime.rescale_grads and regime.spike_factor == 2.0
    stated = OmegaConf.load(CONF_DIR / "regime" / f"{option}.yaml")
    stated = stated.get("regime", stated)  # nan_batch.yaml is in the global package
    unstated = [f.name for f in dataclasses.fields(RegimeConfig) if f.name not in stated]
    base = RunConfig.from_hydra(compose_cfg(f"regime={option}")).regime
    assert all(getattr(base, k) == getattr(RegimeConfig(name=option), k) for k in unstated)


@dataclasses.dataclass
class LateParams(ScalerParams):
    level: float = hp(3.0, v.finite_positive, "test", "a field of the late rule's own")


def test_a_strategy_registered_after_import_gets_its_schema(tmp_path: Path) -> None:
    """A strategy registered after ``import strategies`` (an entry-point plugin, a rule loaded late)
    is composed from a two-line YAML: the schema nodes are stored each time Hydra composes."""
    saved = dict(registry._REGISTRY)
    try:
        @registry.register_strategy("schema_late")
        class Late(NativeStrategy):
            Params = LateParams  # type: ignore[assignment]

        conf = tmp_path / "conf"
        shutil.copytree(CONF_DIR, conf)
        (conf / "strategy" / "schema_late.yaml").write_text(
            "defaults: [/scalelab_schema/strategy/schema_late@_here_, _self_]\nlevel: 5.0\n")
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("config", overrides=["strategy=schema_late", "strategy.growth_interval=7"])
        s = build_strategy(cfg)
        assert s.name == "schema_late" and (s.params.level, s.params.growth_interval) == (5.0, 7)
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
