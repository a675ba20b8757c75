"""``experiments.app.config.RunConfig``: the typed run options the loop reads. Validation is
:func:`experiments.app.build.validate`'s (reused, not repeated): a bad type or value is the same
one-line ``ConfigError``; good values come out typed and equal to the composed config's."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from experiments.app.build import ConfigError, validate
from experiments.app.config import RunConfig
from experiments.app.recipe import lr_at
from tests.experiments.runs import QUIET, TINY, compose_cfg


def _cfg(*overrides: str):
    return compose_cfg(*TINY["mlp"], *QUIET, *overrides)


def test_values_come_out_typed_and_equal_to_the_config() -> None:
    cfg = _cfg("train.steps=40", "train.kill_at_step=7", "regime=spikes", "seed=5", "tags=[a,b]")
    run = RunConfig.from_hydra(cfg)
    assert run.seed == 5 and run.threads == 1 and run.tags == ("a", "b") and run.device == "cpu"
    t = run.train
    for key, value in OmegaConf.to_container(cfg.train, resolve=True).items():  # every train.* option
        assert getattr(t, key) == value and type(getattr(t, key)) is type(value), key
    assert run.regime.spike_steps == frozenset(cfg.regime.spike_steps) and run.regime.rescale_grads is True
    assert run.regime.multiplier(10) == 1e4 and run.regime.multiplier(11) == 1.0
    lr = t.lr_schedule(3e-3)
    assert [lr(s) for s in range(1, 41)] == [lr_at(s, 40, 3e-3, t.lr_warmup, t.lr_decay, t.min_lr_ratio)
                                            for s in range(1, 41)]


def test_step_predicates_match_the_documented_cadence() -> None:
    t = RunConfig.from_hydra(_cfg("train.steps=23", "train.log_every=5", "train.hist_every=7",
                                  "train.checkpoint_every=10")).train
    assert [s for s in range(1, 24) if t.log_step(s)] == [5, 10, 15, 20, 23]
    # the first logging step at or after each multiple of 7 (7, 14, 21): 10, 15, 23
    assert [s for s in range(1, 24) if t.histogram_step(s)] == [10, 15, 23]
    assert [s for s in range(1, 24) if t.checkpoint_step(s)] == [10, 20]


@pytest.mark.parametrize("override", [
    "train.steps=0", "train.steps=1.5", "train.log_every=x", "train.grad_clip=-1", "train.resume=maybe",
    "train.lr_decay=linear", "train.kill_at_step=0", "regime.spike_factor=0", "threads=0", "seed=-1",
])
def test_bad_values_are_the_validators_one_line_errors(override: str) -> None:
    cfg = _cfg(override)
    with pytest.raises(ConfigError) as expected:
        validate(cfg)
    with pytest.raises(ConfigError) as got:
        RunConfig.from_hydra(cfg)
    key = override.split("=")[0]
    assert str(got.value) == str(expected.value) and key in str(got.value) and "\n" not in str(got.value)
