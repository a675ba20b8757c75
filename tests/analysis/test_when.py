"""Issue 12 item 5: the verdict as a "which strategy when" table, on synthetic sweeps whose
differences are known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.load import load_runs
from analysis.metrics import METRICS, label
from analysis.report import build_report
from analysis.tables import compare_to_baseline, compare_to_reference
from analysis.when import ORDER, which_strategy_when
from analysis.words import (BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE, NEGLIGIBLE, NO_DIFFERENCE,
                            NOT_COMPARABLE, WORSE_FEW)
from tests.analysis.synth import SweepSpec, write_sweep

N_BOOT = 200


def _when(root: Path) -> pd.DataFrame:
    runs = load_runs(root).runs
    comps = pd.concat([compare_to_baseline(runs, n_boot=N_BOOT),
                       compare_to_reference(runs, n_boot=N_BOOT)], ignore_index=True)
    return which_strategy_when(runs, comps).set_index("precision")


def _tie_finals(seeds: int, *extra: tuple[str, str, list[float]]) -> dict:
    """native and max_ema with the same final loss in every seed; the fp32 reference far below
    (neither reaches its half-time loss: time to target is inf on both sides, not comparable)."""
    base = list(2.4 + 0.3 * np.sin(np.arange(seeds)))
    finals = {("native", "fp16"): base, ("max_ema", "fp16"): list(base),
              ("none", "fp32"): [b - 0.5 for b in base]}
    finals.update({(s, p): v for s, p, v in extra})
    return finals


def test_one_rule_clearly_beats_native_and_the_report_says_so_first(sweep, tmp_path):
    root, _ = sweep
    build_report([root], tmp_path / "o", n_boot=N_BOOT)
    when = pd.read_csv(tmp_path / "o" / "which_strategy_when.csv", keep_default_na=False)
    assert list(when["precision"]) == ["fp16"]  # fp32 cells have no row
    row = when.iloc[0]
    assert (row["best_strategy"], row["decided_by"]) == ("max_ema", "final_primary")
    assert row["vs_native_reading"] == CLEARLY_BETTER and float(row["vs_native_diff"]) < -0.1
    # 0.5 vs the reference's 0.45, independent draws of sd 0.01, 3 seeds, Holm over 4 rules
    assert row["vs_fp32_reading"] in (CLEARLY_WORSE, WORSE_FEW)
    assert float(row["vs_fp32_diff"]) == pytest.approx(0.05, abs=0.02)
    assert "`max_ema`, `layerwise`; `max_ema` has the largest paired gain" in row["reason"]
    md = (tmp_path / "o" / "report.md").read_text(encoding="utf-8")
    verdict = md.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert verdict.index("| regime | precision | best strategy |") < verdict.index("**Verdict:**")
    assert ("primary metric, then time to target, then lost gradient entries, then 1 - cosine "
            "to fp32, then skipped steps") in verdict and "then strategy overhead" not in verdict
    assert "| `plain` | `fp16` | `max_ema` | primary metric |" in verdict
    assert "The loss gap to fp32" in md and "time to target (steps)" in md


def test_no_true_effect_names_no_best(tmp_path):
    noise = [0.01, -0.01, 0.005, -0.005, 0.0]
    finals = _tie_finals(5)
    finals[("max_ema", "fp16")] = [a + b for a, b in zip(finals[("native", "fp16")], noise)]
    write_sweep(tmp_path / "s", SweepSpec(seeds=5, extras=False, fp32_reference=False,
                                          finals=finals, skipping=("native", "max_ema")))
    row = _when(tmp_path / "s").loc["fp16"]
    assert row["best_strategy"] == "" and row["decided_by"] == ""
    assert row["vs_native_reading"] == NO_DIFFERENCE
    assert "no rule better than `native` on any metric" in row["reason"]
    assert row["strategy_shown"] == "native" and row["vs_fp32_reading"] == CLEARLY_WORSE


def test_a_bf16_control_without_native_is_compared_with_fp32(tmp_path):
    finals = _tie_finals(3)
    finals[("none", "bf16")] = [f + 0.1 for f in finals[("none", "fp32")]]
    write_sweep(tmp_path / "s", SweepSpec(seeds=3, extras=False, fp32_reference=False,
                                          finals=finals))
    when = _when(tmp_path / "s")
    assert sorted(when.index) == ["bf16", "fp16"]
    row = when.loc["bf16"]
    assert row["best_strategy"] == "" and row["strategy_shown"] == "none"
    assert row["vs_native_reading"] == "" and math.isnan(row["vs_native_diff"])
    assert row["vs_fp32_reading"] == CLEARLY_WORSE
    assert row["vs_fp32_diff"] == pytest.approx(0.1)
    assert "no `native` here: compared with the fp32 run of the same seed only" in row["reason"]


def test_final_loss_ties_but_fidelity_decides(tmp_path):
    write_sweep(tmp_path / "s", SweepSpec(seeds=3, extras=False, fp32_reference=False,
                                          finals=_tie_finals(3), fidelity_every=5))
    row = _when(tmp_path / "s").loc["fp16"]
    assert (row["best_strategy"], row["decided_by"]) == ("max_ema", "fidelity_lost_frac_mean")
    assert row["vs_native_reading"] == CLEARLY_BETTER
    assert row["vs_native_diff"] == pytest.approx(-0.02, rel=0.2)
    assert row["reason"].startswith("nothing clearly better on primary metric, time to target; "
                                    "the only rule clearly better than `native` on lost gradient")


def _comps(rows: list[tuple[str, str, str, float]]) -> pd.DataFrame:
    return pd.DataFrame([dict(workload="w", precision="fp16", strategy=s, baseline=b, metric=m,
                              reading=r, paired_diff=d, paired_diff_lo=d - 1, paired_diff_hi=d + 1)
                         for s, b, m, r, d in rows])


def test_the_order_is_lexicographic_and_better_few_is_not_called_best():
    runs = pd.DataFrame({"workload": "w", "regime": "plain", "precision": "fp16",
                         "strategy": ["native", "a", "b"], "seed": 0, "status": "completed"})
    comps = _comps([("a", "native", ORDER[0], CLEARLY_WORSE, 1.0),
                    ("b", "native", ORDER[0], NO_DIFFERENCE, 0.0),
                    ("a", "native", ORDER[1], CLEARLY_BETTER, -9.0),
                    ("b", "native", ORDER[1], CLEARLY_BETTER, -3.0)])
    row = which_strategy_when(runs, comps).iloc[0]
    assert (row["best_strategy"], row["decided_by"]) == ("b", "steps_to_target")
    assert "not counted, clearly worse on an earlier metric: `a`" in row["reason"]
    comps = _comps([("a", "native", ORDER[2], BETTER_FEW, -0.1),
                    ("b", "native", ORDER[0], NO_DIFFERENCE, 0.0)])
    row = which_strategy_when(runs, comps).iloc[0]
    assert row["best_strategy"] == "" and row["strategy_shown"] == "a"
    assert row["vs_native_reading"] == BETTER_FEW and row["decided_by"] == ORDER[2]
    comps = _comps([("a", "native", ORDER[0], CLEARLY_WORSE, 1.0),
                    ("b", "native", ORDER[4], WORSE_FEW, 2.0)])
    row = which_strategy_when(runs, comps).iloc[0]
    assert row["best_strategy"] == "native" and "`a`" in row["reason"]
    comps = _comps([("a", "native", ORDER[0], NOT_COMPARABLE, float("nan"))])
    assert which_strategy_when(runs, comps).iloc[0]["vs_native_reading"] == NOT_COMPARABLE


def test_a_negligible_difference_names_no_winner():
    """docs/findings.md named `static` best on 1 - cosine by -8e-08: read NEGLIGIBLE, it is no win."""
    runs = pd.DataFrame({"workload": "w", "regime": "plain", "precision": "fp16",
                         "strategy": ["native", "a", "b"], "seed": 0, "status": "completed"})
    comps = _comps([("a", "native", ORDER[3], NEGLIGIBLE, -8e-8),
                    ("b", "native", ORDER[0], CLEARLY_WORSE, 1.0)])
    row = which_strategy_when(runs, comps).iloc[0]
    assert row["best_strategy"] == "" and row["vs_native_reading"] == NEGLIGIBLE
    assert f"every paired reading is '{NEGLIGIBLE}' or worse" in row["reason"]


def test_docs_name_every_metric_and_the_order():

    doc = (Path(__file__).resolve().parents[2] / "docs" / "report.md").read_text("utf-8")
    for m in METRICS:
        assert f"| {m.label} | `{m.column}` |" in doc, m.column
    steps = "\n".join(f"{i}. {label(m)}" for i, m in enumerate(ORDER, start=1))
    assert steps in doc
