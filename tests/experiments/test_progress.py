"""experiments/app/progress.py: the job count a sweep announces is the basic sweeper's, and the kernel
extension is built before any worker starts. (The per-job lines of real sweeps are checked in
test_launchers.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path

from experiments.app.progress import SweepProgress, count_jobs, job_line
from experiments.app.train import CONF_DIR

CASES = [
    ({"precision": "fp16", "regime": "plain,tiny_grad,spikes", "seed": "0,1,2,3,4",
      "strategy": "glob(*,exclude=[megatron,deepspeed*,fairseq,te_delayed,*_capped])"}, []),
    ({"regime": "plain,tiny_grad", "seed": "0,1,2"}, ["seed=0", "strategy=glob(n*)"]),  # the command line replaces a key
    ({}, ["strategy=native,max_ema", "seed=range(0,4)", "train.steps=5"]),
    ({"precision": "fp32,bf16", "strategy": "none"}, ["+experiment=compare"]),
]


def _jobs(params: dict, task: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes (its own parser, with a config loader for globs)."""
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
    parsed = OverridesParser.create(config_loader=loader).parse_overrides([f"{k}={v}" for k, v in params.items()] + task)
    (jobs,) = BasicSweeper.split_arguments(parsed, None)
    return jobs


@pytest.mark.parametrize("params,task", CASES)
def test_the_count_is_the_basic_sweepers(params: dict, task: list[str]) -> None:
    assert count_jobs(params, task) == len(_jobs(params, task)) > 1


def test_the_kernels_are_built_before_the_workers(tmp_path: Path, monkeypatch) -> None:
    import strategies.kernels as kernels

    calls = []
    monkeypatch.setattr(kernels, "load", lambda: calls.append("load") or True)
    cfg = compose_hydra(["+experiment=compare", f"hydra.sweep.dir={tmp_path}"])
    (tmp_path / ".progress").mkdir()
    (tmp_path / ".progress" / "done").write_text("1\n1\n")  # a previous attempt's count
    SweepProgress().on_multirun_start(cfg)
    assert calls == ["load"]
    start = json.loads((tmp_path / ".progress" / "start.json").read_text())
    assert start["total"] == count_jobs(dict(cfg.hydra.sweeper.params), []) and start["total"] >= 5 * 12
    assert not (tmp_path / ".progress" / "done").exists()


def test_the_job_line_names_the_job_and_survives_a_missing_record() -> None:
    line = job_line(3, 12, 30.0, {"precision": "fp16", "regime": "tiny_grad", "strategy": "max_ema", "seed": 4,
                                  "status": "completed", "final_eval_loss": 2.41234, "skipped_steps": 2})
    assert line == "[ 3/12] fp16 tiny_grad max_ema seed 4: completed, final eval loss 2.412, 2 skipped | 30s, ETA 1m30s"
    assert job_line(1, 1, 0.0, {}).startswith("[1/1] ? ? ? seed ?: no record, final eval loss n/a")
    rl = job_line(1, 2, 10.0, {"precision": "fp16", "regime": "rl", "strategy": "verl", "seed": 0, "status": "completed",
                               "final_reward": 0.58594, "final_eval_loss": 3.0, "skipped_steps": 0})
    assert rl.startswith("[1/2] fp16 rl verl seed 0: completed, final reward 0.5859, final eval loss 3, 0 skipped")


def test_the_sweeper_composes_a_covering_sample_before_launch(monkeypatch) -> None:
    """hydra_plugins/scalelab_sweeper: every key=value of the grid is composed before launch, in at
    most as many jobs as the keys have values together, instead of composing all of them."""
    from hydra_plugins.scalelab_sweeper import GridSweeper, covering

    params, task = CASES[0]
    batch = _jobs(params, task)
    sample = covering(batch)
    assert {kv for job in sample for kv in job} == {kv for job in batch for kv in job}
    values = [len({job[i] for job in batch}) for i in range(len(batch[0]))]
    assert max(values) <= len(sample) <= sum(values) < len(batch) / 5
    seen = []
    from hydra.plugins.sweeper import Sweeper  # where Hydra's check is implemented

    monkeypatch.setattr(Sweeper, "validate_batch_is_legal", lambda self, b: seen.append(list(b)))
    GridSweeper(max_batch_size=None).validate_batch_is_legal(batch)
    assert seen == [sample]
    cfg = compose_hydra(["+experiment=compare"])
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.scalelab_sweeper.GridSweeper"


def compose_hydra(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)
