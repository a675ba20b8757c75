"""``+experiment=compare`` and the three command-line variants ``make compare`` runs (fp8_e5m2;
nvfp4; the fp32 reference and bf16 control) expand to the documented grids over the natural workloads
(issue 30); ``stress`` (the synthetic multipliers, ``make stress``) and ``compare_tiny`` keep the
grid the default comparison had before.

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

WORKLOADS = ["finetune", "rl", "deep_narrow", "cnn_deep"]  # compare's regimes: the natural workloads
FP8 = ["precision=fp8_e5m2", "workload=finetune"]
BLOCK = ["precision=nvfp4", "workload=finetune", "strategy=native,none"]
CONTROLS = ["precision=fp32,bf16", "strategy=none"]
SEEDS = [0, 1, 2]
REGIMES = ["plain", "tiny_grad", "spikes"]  # stress's: the synthetic multipliers
STRESS_FP8 = ["precision=fp8_e5m2", "regime=plain"]
STRESS_SEEDS = [0, 1, 2, 3, 4]
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


def _grid(jobs: list[dict[str, str]], axis: str = "regime") -> list[tuple[str, str, str, int]]:
    return sorted((j["precision"], j[axis], j["strategy"], int(j["seed"])) for j in jobs)


def rules() -> list[str]:
    strategies = sorted(set(group_options("strategy")) - PRESETS)
    assert "none" in strategies and PRESETS <= set(group_options("strategy")) and len(strategies) >= 2
    return strategies


def test_compare_is_every_rule_in_fp16_by_natural_workload_and_seed() -> None:
    expected = sorted(itertools.product(["fp16"], WORKLOADS, rules(), SEEDS))
    assert _grid(expand("compare"), "workload") == expected


def test_the_fp8_sweep_is_every_rule_on_finetune_in_fp8_e5m2() -> None:
    assert _grid(expand("compare", *FP8), "workload") == sorted(
        itertools.product(["fp8_e5m2"], ["finetune"], rules(), SEEDS))


def test_the_controls_are_one_unscaled_fp32_and_bf16_run_per_workload_and_seed() -> None:
    assert _grid(expand("compare", *CONTROLS), "workload") == sorted(
        itertools.product(["bf16", "fp32"], WORKLOADS, ["none"], SEEDS))


def test_stress_keeps_the_synthetic_multipliers() -> None:
    assert _grid(expand("stress")) == sorted(itertools.product(["fp16"], REGIMES, rules(), STRESS_SEEDS))
    assert _grid(expand("stress", *STRESS_FP8)) == sorted(
        itertools.product(["fp8_e5m2"], ["plain"], rules(), STRESS_SEEDS))
    assert _grid(expand("stress", *CONTROLS)) == sorted(
        itertools.product(["bf16", "fp32"], REGIMES, ["none"], STRESS_SEEDS))


def test_the_makefile_runs_these_four_sweeps_then_the_report() -> None:
    make = (CONF_DIR.parent / "Makefile").read_text()
    body = make.split("\ncompare: ")[1].split("\n\n")[0]
    assert [ln.split("-m ", 1)[1].replace(" hydra.sweep.dir=$(OUT)", "") for ln in body.splitlines() if " -m " in ln] == [
        "+experiment=$(EXPERIMENT)", "+experiment=$(EXPERIMENT) precision=fp8_e5m2 $(FP8_SWEEP)",
        "+experiment=$(EXPERIMENT) " + BLOCK[0] + " $(BLOCK_SWEEP)", "+experiment=$(EXPERIMENT) " + " ".join(CONTROLS)]
    assert "EXPERIMENT ?= compare\n" in make and "scalelab-report $(OUT)" in body
    assert "FP8_SWEEP  ?= " + FP8[1] + "\n" in make and "BLOCK_SWEEP ?= " + " ".join(BLOCK[1:]) + "\n" in make
    stress = make.split("\nstress: ")[1].split("\n\n")[0]
    assert "EXPERIMENT=stress" in stress and "FP8_SWEEP=" + STRESS_FP8[1] in stress
    assert "BLOCK_SWEEP='regime=plain strategy=native,none'" in stress


def test_the_block_sweep_is_nvfp4_finetune_with_and_without_a_loss_scaler() -> None:
    """Issue 31: one block-scaled regime; power-of-two loss scales commute exactly with the block
    scales, so two scalers (GradScaler and none) are the cell, against the fp32 runs of the controls."""
    jobs = expand("compare", *BLOCK)
    assert _grid(jobs, "workload") == sorted(itertools.product(["nvfp4"], ["finetune"], ["native", "none"], SEEDS))
    cfg = _job_cfg("compare", jobs[0])
    assert cfg.precision.name == "nvfp4" and cfg.precision.blocks.recipe == "nvfp4" and cfg.regime.name == "finetune"
    stress = expand("stress", "precision=nvfp4", "regime=plain", "strategy=native,none")
    assert {(j["regime"], j["strategy"]) for j in stress} == {("plain", "native"), ("plain", "none")}


def test_compare_tiny_is_the_stress_grid() -> None:
    for cli, fp8 in (((), ()), (STRESS_FP8, STRESS_FP8), (CONTROLS, CONTROLS)):
        assert _grid(expand("compare_tiny", *cli)) == _grid(expand("stress", *fp8))


def test_compare_full_is_every_preset_with_8_seeds_at_the_courts_horizon() -> None:
    for cli in ((), FP8, CONTROLS):
        grid = set(_grid(expand("compare_full", *cli), "workload"))
        base = set(_grid(expand("compare", *cli), "workload"))
        assert base < grid and {k for *_, k in grid} == set(range(8))
        assert {s for _, _, s, _ in grid} >= (PRESETS if cli != CONTROLS else {"none"})
    assert _compose(CONF_DIR, ["+experiment=compare_full"]).train.steps == 800


def _job_cfg(experiment: str, job: dict[str, str]) -> DictConfig:
    return _compose(CONF_DIR, [f"+experiment={experiment}", *(f"{k}={v}" for k, v in job.items())])


def _workload(cfg: DictConfig) -> dict:
    """Everything but the arm (precision, strategy) and Hydra's own node."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(plain, dict)
    return {k: v for k, v in plain.items() if k not in ("precision", "strategy", "hydra")}


WORKLOAD_MODELS = {"finetune": ("gpt_pretrained", "finetune_chars"), "rl": ("gpt_pretrained", "rl_vowels"),
                   "deep_narrow": ("deep_narrow", "images"), "cnn_deep": ("cnn_deep", "images")}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_reference_runs_the_same_workload_as_the_fp16_arms(workload: str) -> None:
    fp16 = {j["strategy"]: _job_cfg("compare", j) for j in expand("compare")
            if j["workload"] == workload and j["seed"] == "0"}
    (ref_job,) = [j for j in expand("compare", *CONTROLS)
                  if j["workload"] == workload and j["seed"] == "0" and j["precision"] == "fp32"]
    ref = _job_cfg("compare", ref_job)
    assert ref.precision.name == "fp32" and ref.hydra.runtime.choices.strategy == "none"
    for name, cfg in fp16.items():
        assert cfg.precision.name == "fp16"
        assert cfg.hydra.runtime.choices.strategy == name
        assert _workload(cfg) == _workload(ref), f"fp16-{name} and the fp32 reference differ beyond the arm"
    assert (ref.model.name, ref.data.name) == WORKLOAD_MODELS[workload] and ref.sweep == "compare"
    assert ref.regime.name == workload and ref.regime.loss_multiplier == 1.0  # no multiplier: natural
    assert ref.train.steps == 300 and ref.train.checkpoint_every % 2 == 0  # rl checkpoints on rollout boundaries
    assert ref.hydra.launcher._target_.endswith("JoblibLauncher")


def test_a_new_strategy_yaml_joins_the_comparison(tmp_path: Path) -> None:
    """glob(*) over conf/strategy: dropping in a YAML adds its arm, with no edit to compare.yaml."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    shutil.copy(conf / "strategy" / "native.yaml", conf / "strategy" / "zz_new_rule.yaml")
    arms = {j["strategy"] for j in expand("compare", conf_dir=conf)}
    assert arms == (set(group_options("strategy")) - PRESETS) | {"zz_new_rule"}
