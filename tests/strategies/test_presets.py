"""Every YAML in ``conf/strategy/`` fits its rule's schema and builds; the industry presets carry
their sources' numbers (cited in each file)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import strategies
from tests.helpers import CONF as CONF_ROOT
from tests.helpers import PRESETS as YAMLS
from tests.helpers import preset_keywords as keywords

CONF = CONF_ROOT / "strategy"


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_every_yaml_merges_into_its_schema_and_builds(path: Path) -> None:
    name, kw = keywords(path)
    merged = OmegaConf.merge(OmegaConf.structured(strategies.get(name).Params), kw)
    s = strategies.create(name, **kw)
    assert s.name == name
    for key, value in kw.items():
        assert merged[key] == value, key
        assert value is None or getattr(s.params, key) == value, key  # null may resolve to a rule default


def test_a_bad_value_in_a_preset_is_a_one_line_error() -> None:
    name, kw = keywords(CONF / "deepspeed.yaml")
    with pytest.raises(ValueError) as e:
        strategies.create(name, **{**kw, "min_scale": None})
    assert str(e.value) == "min_scale must be a number when on_min_scale='raise', got None"


PRESETS = {
    "megatron": ("native", dict(init_scale=2.0**32, growth_interval=1000, hysteresis=2, hysteresis_refill="growth",
                                min_scale=1.0, on_min_scale="clamp")),
    "deepspeed": ("native", dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2, hysteresis_refill="growth",
                                 min_scale=1.0, on_min_scale="raise")),
    "deepspeed_consecutive": ("native", dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2,
                                             hysteresis_refill="clean_step", min_scale=1.0, on_min_scale="raise")),
    "fairseq": ("tolerance", dict(init_scale=128.0, growth_interval=2**14, tolerance=0.0, min_scale=1e-4,
                                  on_min_scale="raise")),
    "te_delayed": ("amax_history", dict(history_len=1024, algo="max", margin=1.0)),
    "max_ema_capped": ("max_ema", dict(cap_ema_on_overflow=True)),
    "layerwise_capped": ("layerwise", dict(cap_ema_on_overflow=True)),
    "static": ("static", dict(init_scale=1024.0)),
    # the court's presets and remedies (issue 30; tests/strategies/test_court_presets.py drives them)
    "verl": ("native", dict(init_scale=2.0**16, growth_interval=400, hysteresis=1, min_scale=None)),
    "areal": ("native", dict(init_scale=2.0**32, growth_interval=5, hysteresis=2, hysteresis_refill="growth",
                             min_scale=1.0, on_min_scale="clamp")),
    "oat": ("native", dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2, hysteresis_refill="growth",
                           min_scale=1.0, on_min_scale="raise")),
    "min_scale_1e-10": ("native", dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1e-10,
                                       on_min_scale="raise")),
    "hysteresis2": ("native", dict(init_scale=2.0**16, growth_interval=2000, hysteresis=2, min_scale=None)),
    "init_2p32": ("native", dict(init_scale=2.0**32, growth_interval=2000, hysteresis=1, min_scale=None)),
    "static8": ("static", dict(init_scale=8.0)),
    "fairseq_tolerance": ("tolerance", dict(init_scale=128.0, growth_interval=2**14, tolerance=0.25, min_scale=1e-4,
                                            on_min_scale="raise")),
    "metaseq": ("tolerance", dict(init_scale=4.0, growth_interval=256, tolerance=0.0, min_scale=2.0**-5,
                                  on_min_scale="clamp", window_follows_scale=True)),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_numbers(preset: str) -> None:
    name, kw = keywords(CONF / f"{preset}.yaml")
    rule, expected = PRESETS[preset]
    params = strategies.create(name, **kw).params
    assert name == rule
    assert {k: getattr(params, k) for k in expected} == expected
    if name in ("native", "tolerance"):
        assert (params.growth_factor, params.backoff_factor) == (2.0, 0.5)


def test_every_rule_has_a_yaml() -> None:
    assert set(strategies.available()) <= {keywords(p)[0] for p in YAMLS}
