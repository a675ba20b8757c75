"""``+experiment=compare`` and the two command-line variants ``make compare`` runs (fp8_e5m2;
the fp32 reference and bf16 control) expand to the documented grids.

The grid is expanded the way ``scalelab-train -m`` expands it: the composed
``hydra.sweeper.params`` go through Hydra's override parser (with a config loader, so
``glob(*)`` lists the config group's options) and ``BasicSweeper.split_arguments`` -- the code path
of Hydra 1.3's basic sweeper -- and every job is then composed with the compose API.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from experiments.app.train import CONF_DIR, group_options

REGIMES = ["plain", "tiny_grad", "spikes"]
FP8 = ["precision=fp8_e5m2", "regime=plain"]
CONTROLS = ["precision=fp32,bf16", "strategy=none"]
SEEDS = [0, 1, 2, 3, 4]
PRESETS = {"megatron", "deepspeed", "deepspeed_consecutive", "fairseq", "te_delayed", "max_ema_capped",
           "layerwise_capped",  # industry presets of one rule: left to strategy='glob(*)'
           "verl", "areal", "oat", "metaseq", "static8", "min_scale_1e-10", "fairseq_tolerance", "hysteresis2",
           "init_2p32"}  # the court's presets and remedies (conf/experiment/court_*.yaml)


def _compose(conf_dir: Path, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def expand(experiment: str, *cli: str, conf_dir: Path = CONF_DIR) -> list[dict[str, str]]:
    """The jobs ``scalelab-train -m +experiment=<experiment> <cli>`` launches, as override dicts."""
    cfg = _compose(conf_dir, [f"+experiment={experiment}"])
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + list(cli)
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(conf_dir)))
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(params)
    (jobs,) = BasicSweeper.split_arguments(overrides, max_batch_size=None)
    return [dict(o.split("=", 1) for o in job) for job in jobs]


def _grid(jobs: list[dict[str, str]]) -> list[tuple[str, str, str, int]]:
    return sorted((j["precision"], j["regime"], j["strategy"], int(j["seed"])) for j in jobs)


def test_compare_is_every_strategy_in_fp16_by_regime_and_seed() -> None:
    strategies = sorted(set(group_options("strategy")) - PRESETS)
    assert "none" in strategies and PRESETS <= set(group_options("strategy")) and len(strategies) >= 2
    expected = sorted(itertools.product(["fp16"], REGIMES, strategies, SEEDS))
    assert _grid(expand("compare")) == expected


def test_the_fp8_sweep_is_every_strategy_in_fp8_e5m2() -> None:
    strategies = sorted(set(group_options("strategy")) - PRESETS)
    assert _grid(expand("compare", *FP8)) == sorted(itertools.product(["fp8_e5m2"], ["plain"], strategies, SEEDS))


def test_the_controls_are_one_unscaled_fp32_and_bf16_run_per_regime_and_seed() -> None:
    assert _grid(expand("compare", *CONTROLS)) == sorted(itertools.product(["bf16", "fp32"], REGIMES, ["none"], SEEDS))


def test_the_makefile_runs_these_three_sweeps_then_the_report() -> None:
    make = (CONF_DIR.parent / "Makefile").read_text()
    body = make.split("\ncompare: ")[1].split("\n\n")[0]
    assert [ln.split("-m ", 1)[1].replace(" hydra.sweep.dir=$(OUT)", "") for ln in body.splitlines() if " -m " in ln] == [
        "+experiment=$(EXPERIMENT)", "+experiment=$(EXPERIMENT) " + " ".join(FP8), "+experiment=$(EXPERIMENT) " + " ".join(CONTROLS)]
    assert "EXPERIMENT ?= compare\n" in make and "scalelab-report $(OUT)" in body


@pytest.mark.parametrize("experiment", ["compare_tiny", "compare_full"])
def test_variants_have_the_same_grids(experiment: str) -> None:
    for cli in ((), FP8, CONTROLS):
        grid = {(p, r, s, k) for p, r, s, k in _grid(expand(experiment, *cli))}
        base = set(_grid(expand("compare", *cli)))
        if experiment == "compare_full":  # every preset, 8 seeds
            assert base < grid and {k for *_, k in grid} == set(range(8))
            assert {s for _, _, s, _ in grid} >= (PRESETS if cli != CONTROLS else {"none"})
            if cli != FP8:  # the doctor's fp16 policy-gradient workload, and its fp32/bf16 controls
                assert {r for _, r, _, _ in grid} == {*REGIMES, "small_advantage"}
        else:
            assert grid == base


def _job_cfg(experiment: str, job: dict[str, str]) -> DictConfig:
    return _compose(CONF_DIR, [f"+experiment={experiment}", *(f"{k}={v}" for k, v in job.items())])


def _workload(cfg: DictConfig) -> dict:
    """Everything but the arm (precision, strategy) and Hydra's own node."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(plain, dict)
    return {k: v for k, v in plain.items() if k not in ("precision", "strategy", "hydra")}


@pytest.mark.parametrize("regime", REGIMES)
def test_reference_runs_the_same_workload_as_the_fp16_arms(regime: str) -> None:
    fp16 = {j["strategy"]: _job_cfg("compare", j) for j in expand("compare") if j["regime"] == regime and j["seed"] == "0"}
    (ref_job,) = [j for j in expand("compare", *CONTROLS) if j["regime"] == regime and j["seed"] == "0" and j["precision"] == "fp32"]
    ref = _job_cfg("compare", ref_job)
    assert ref.precision.name == "fp32" and ref.hydra.runtime.choices.strategy == "none"
    for name, cfg in fp16.items():
        assert cfg.precision.name == "fp16"
        assert cfg.hydra.runtime.choices.strategy == name
        assert _workload(cfg) == _workload(ref), f"fp16-{name} and the fp32 reference differ beyond the arm"
    assert ref.model.name == "gpt" and ref.data.name == "stdlib_chars" and ref.sweep == "compare"
    assert ref.regime.name == regime
    if regime == "tiny_grad":
        assert ref.regime.loss_multiplier == pytest.approx(1e-8)
    assert ref.hydra.launcher._target_.endswith("JoblibLauncher")


def test_a_new_strategy_yaml_joins_the_comparison(tmp_path: Path) -> None:
    """glob(*) over conf/strategy: dropping in a YAML adds its arm, with no edit to compare.yaml."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    shutil.copy(conf / "strategy" / "native.yaml", conf / "strategy" / "zz_new_rule.yaml")
    arms = {j["strategy"] for j in expand("compare", conf_dir=conf)}
    assert arms == (set(group_options("strategy")) - PRESETS) | {"zz_new_rule"}
