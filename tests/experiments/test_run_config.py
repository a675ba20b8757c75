"""``experiments.app.config.RunConfig``: the typed run options the loop reads. Each option is one
``hp`` field (type, default, check, source); a bad type or value is a one-line ``ConfigError``
naming the qualified option; good values come out typed and equal to the composed config's, whose
defaults are the dataclasses' own (``scalelab_schema/run``)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from experiments.app.build import ConfigError
from experiments.app.config import RegimeConfig, RunConfig, TrainConfig
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


@pytest.mark.parametrize("override,message", [
    ("train.steps=0", "train.steps must be an integer >= 1, got 0"),
    ("train.steps=1.5", "train.steps must be an integer >= 1, got 1.5"),
    ("train.log_every=x", "train.log_every must be an integer >= 1, got 'x'"),
    ("train.grad_clip=-1", "train.grad_clip must be a number in [0, inf], got -1"),
    ("train.resume=maybe", "train.resume must be true or false, got 'maybe'"),
    ("train.lr_decay=linear", "train.lr_decay must be one of cosine, constant, got 'linear'"),
    ("train.kill_at_step=0", "train.kill_at_step must be an integer >= 1, got 0"),
    ("regime.spike_factor=0", "regime.spike_factor must be a number in (0, 1e+12], got 0"),
    ("threads=0", "threads must be an integer in [1, 1024], got 0"),
    ("seed=-1", "seed must be an integer >= 0, got -1"),
    ("+train.stpes=3", "train.stpes is not an option; train.* are: steps, batch_size, "),
])
def test_bad_values_are_one_line_errors_naming_the_option(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as got:
        RunConfig.from_hydra(_cfg(override))
    key = override.split("=")[0].lstrip("+")
    assert str(got.value).startswith(message) and key in str(got.value) and "\n" not in str(got.value)


def test_the_dataclasses_are_the_defaults_of_the_composed_config() -> None:
    """One home per default: the config tree states no run option the dataclasses do not."""
    run = RunConfig.from_hydra(compose_cfg())
    assert run.train == TrainConfig() and run.regime == RegimeConfig(name="plain")
    assert (run.seed, run.device, run.threads, run.sweep, run.tags) == (0, "cpu", None, "adhoc", ())
