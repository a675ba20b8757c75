"""Each workload's primary metric comes from one place, and a court cell is its own row (issue 30).

The workload declares its primary metric (``conf/workload/rl.yaml``: ``regime.primary:
final_reward``), the app writes it into ``summary.json`` (``primary``), and both the report
(``analysis.tables`` through the runs table's ``final_primary``) and the court
(:func:`analysis.court.readings.primary_for`) read it from there. Checked on real runs written by
``scalelab-train`` in one subprocess per sweep (the court's rl experiment at tiny sizes, 4 steps:
``native`` and ``areal``, then ``native`` with the LM head in fp32 as ``cell=-keep_head_fp32``,
3 seeds each), against the values read back from the ``summary.json`` files in plain Python.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.court.readings import court_cells, primary_for
from analysis.load import load_runs
from analysis.tables import rank_strategies, summarize
from experiments.schema import SUMMARY_NAME, cell_of, primary_of
from tests.experiments.runs import TINY, cli

SEEDS = (0, 1, 2)
TINY_RL = [*TINY["rl"], "train.steps=4", "train.lr_warmup=1", "train.eval_every=4",
           "train.fidelity_every=2", "train.log_every=2", "seed=0,1,2", "hydra/launcher=basic"]


@pytest.fixture(scope="module")
def court(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep = tmp_path_factory.mktemp("court")
    for cells in (["strategy=native,areal"],
                  ["strategy=native", "model.keep_fp32=[head]", "cell=-keep_head_fp32"]):
        proc = cli("-m", "+experiment=court_rl", *cells, *TINY_RL, f"hydra.sweep.dir={sweep}",
                   timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return sweep


def _summaries(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob(SUMMARY_NAME))]


def test_the_rl_workload_declares_its_reward_and_the_run_records_carry_it(court: Path) -> None:
    summaries = _summaries(court)
    assert len(summaries) == 9
    assert {s["primary"] for s in summaries} == {"final_reward"}
    assert all(isinstance(s["final_reward"], float) for s in summaries)
    assert sorted(s.get("cell", "") for s in summaries) == ["", ""] * 3 + ["-keep_head_fp32"] * 3
    keep = [s for s in summaries if s.get("cell")]
    assert all(s["keep_fp32"] == ["head"] and s["strategy"] == "native" for s in keep)


def test_the_report_ranks_rl_by_reward_higher_first(court: Path) -> None:
    runs = load_runs([court]).runs
    by_file = {(s["strategy"] + s.get("cell", ""), s["seed"]): s["final_reward"]
               for s in _summaries(court)}
    got = {(r.strategy, r.seed): -r.final_primary for r in runs.itertuples()}
    assert got == pytest.approx(by_file)  # the report's primary is the reward, negated
    summary = summarize(runs, n_boot=200)
    means = summary.set_index("strategy")["final_primary_mean"]
    for strategy in ("native", "areal", "native-keep_head_fp32"):
        rewards = [v for (s, _), v in by_file.items() if s == strategy]
        assert len(rewards) == 3 and means[strategy] == pytest.approx(-np.mean(rewards))
    assert set(summary["primary"]) == {"final_reward"}
    ranked = rank_strategies(summary)
    order = [float(means[s]) for s in ranked["strategy"]]
    assert order == sorted(order)  # lowest −reward, i.e. highest reward, first


def test_a_cell_is_its_own_strategy_row_in_the_report_and_the_court(court: Path) -> None:
    runs = load_runs([court]).runs
    counts = runs["strategy"].value_counts().to_dict()
    assert counts == {"native": 3, "areal": 3, "native-keep_head_fp32": 3}
    keep = runs[runs["strategy"] == "native-keep_head_fp32"]
    assert set(keep["strategy_option"]) == {"native"} and set(keep["seed"]) == set(SEEDS)
    cells = court_cells(runs, "rl")
    assert sorted(cells) == ["areal", "native", "native + keep head fp32"]
    assert all(len(c.runs) == 3 for c in cells.values())


def test_the_court_reads_the_primary_the_runs_carry(court: Path) -> None:
    p = primary_for(load_runs([court]).runs, "rl")
    assert (p.column, p.higher, p.label) == ("final_reward", True, "final reward")


def test_records_written_before_the_fields_existed() -> None:
    """The court's runs of commit ee26831 carry neither ``primary`` nor ``cell``: a reward
    means rl (ranked by it), the cell is in the fingerprint's resolved config."""
    old = {"final_reward": 0.5, "final_eval_loss": 2.0,
           "fingerprint": {"config": {"cell": "-keep_head_fp32"}}}
    assert primary_of(old) == "final_reward" and cell_of(old) == "-keep_head_fp32"
    assert primary_of({"final_eval_loss": 2.0}) == "final_eval_loss" and cell_of({}) == ""
    assert primary_of({"primary": "final_eval_loss", "final_reward": 0.5}) == "final_eval_loss"
    assert primary_of({"primary": "bogus", "final_eval_loss": 1.0}) == "final_eval_loss"
    assert cell_of({"cell": "", "fingerprint": {"config": {"cell": "-x"}}}) == ""


def test_a_finetune_run_is_ranked_by_its_eval_loss(tmp_path: Path) -> None:
    proc = cli("+workload=finetune", *TINY["pretrainedgpt"], "train.steps=2", "logger=none",
               "train.eval_every=0", f"hydra.run.dir={tmp_path / 'ft'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (summary,) = _summaries(tmp_path)
    assert summary["primary"] == "final_eval_loss" and "cell" not in summary
    runs = load_runs([tmp_path]).runs
    assert runs["final_primary"].tolist() == [summary["final_eval_loss"]]
