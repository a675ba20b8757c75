"""Issue 30, "also seen": an exact tie reads as a tie, and a wall-clock metric names no winner.

Re-running ``make compare`` on the same commit gave the same intervals to the digit, yet the
"best strategy" changed: where two rules tied exactly the name picked followed their order, and
strategy overhead (wall-clock time) flipped between "clearly better" and "too few seeds" with
machine load. Each test feeds the same readings in both orders and expects the same words.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics import FINAL_PRIMARY, STRATEGY_OVERHEAD
from analysis.tables import compare_to_baseline
from analysis.verdict import overall_verdict
from analysis.when import ORDER, table_rows, which_strategy_when
from analysis.words import BETTER_FEW, CLEARLY_BETTER, NO_DIFFERENCE, TIE, TIMING

RUNS = pd.DataFrame({"workload": "w", "regime": "tiny_grad", "precision": "fp16",
                     "strategy": ["native", "amax_history", "underflow_target"], "seed": 0,
                     "status": "completed"})


def _comps(names: list[str], diff: float = -0.769) -> pd.DataFrame:
    return pd.DataFrame([dict(workload="w", precision="fp16", strategy=s, baseline="native",
                              metric=ORDER[0], reading=CLEARLY_BETTER, paired_diff=diff,
                              paired_diff_lo=-0.794, paired_diff_hi=-0.748) for s in names])


def test_an_exact_tie_for_best_reads_tie_in_either_order() -> None:
    for names in (["amax_history", "underflow_target"], ["underflow_target", "amax_history"]):
        when = which_strategy_when(RUNS, _comps(names))
        row = when.iloc[0]
        assert row["best_strategy"] == "" and row["tied"] == "amax_history, underflow_target"
        assert row["reason"].startswith(f"{TIE}: `amax_history`, `underflow_target` are "
                                        f"{CLEARLY_BETTER}")
        _, rows = table_rows(when)
        assert rows[0][2] == f"{TIE}: `amax_history`, `underflow_target`"


def test_a_tie_below_the_digits_shown_is_a_tie() -> None:
    """amax_history and underflow_target on tiny_grad: final losses equal to 1e-5 (a re-run on
    the same commit need not repeat those digits), the same Δ and interval on the page."""
    comps = pd.concat([_comps(["amax_history"], diff=-0.769004),
                       _comps(["underflow_target"], diff=-0.769001)])
    for order in (comps, comps.iloc[::-1]):
        row = which_strategy_when(RUNS, order).iloc[0]
        assert row["best_strategy"] == "" and row["tied"] == "amax_history, underflow_target"


def test_a_larger_gain_is_still_named_best() -> None:
    comps = pd.concat([_comps(["amax_history"]), _comps(["underflow_target"], diff=-0.5)])
    row = which_strategy_when(RUNS, comps).iloc[0]
    assert row["best_strategy"] == "amax_history" and row["tied"] == ""


def _timing_runs(seeds: int = 6) -> pd.DataFrame:
    """native and fast over ``seeds`` seeds: fast's overhead far below native's on every seed,
    the final loss the same."""
    rows = []
    for s in range(seeds):
        for name, over in (("native", 0.2 + 0.01 * s), ("fast", 0.05 + 0.01 * s)):
            rows.append({"workload": "w", "regime": "r", "precision": "fp16", "strategy": name,
                         "seed": s, "status": "completed", "final_primary": 2.0 + 0.1 * s,
                         STRATEGY_OVERHEAD.column: over})
    return pd.DataFrame(rows)


def test_a_wall_clock_metric_is_never_read_and_names_no_winner() -> None:
    runs = _timing_runs()
    comps = compare_to_baseline(runs, metrics=[FINAL_PRIMARY, STRATEGY_OVERHEAD], n_boot=200)
    over = comps[comps["metric"] == STRATEGY_OVERHEAD.column].iloc[0]
    assert over["paired_diff_hi"] < 0 and over["reading"] == TIMING  # the data would say "clearly"
    row = which_strategy_when(runs, comps).iloc[0]
    assert row["best_strategy"] == "" and row["decided_by"] == ""
    assert row["vs_native_reading"] == NO_DIFFERENCE
    assert STRATEGY_OVERHEAD.column not in ORDER


def _board(order: list[str], overhead: dict[str, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    summary = pd.DataFrame([{"workload": "w", "precision": "fp16", "strategy": s,
                             "n_diverged": 0, "n_failed": 0, "n_other": 0, "n_runs": 3,
                             "skipped_steps_mean": 0.0, "act_zero_frac_mean_mean": 0.1,
                             "strategy_overhead_frac_mean": overhead[s],
                             "final_primary_n": 6} for s in order])
    ranks = pd.DataFrame({"workload": "w", "precision": "fp16", "strategy": order, "rank": 1})
    return summary, ranks


def test_the_overall_verdict_reads_an_exact_tie_as_a_tie_and_ignores_overhead() -> None:
    over = {"amax_history": 0.30, "underflow_target": 0.01}  # the overhead alone differs
    texts = {overall_verdict(*_board(order, over))
             for order in (list(over), list(reversed(over)))}
    assert len(texts) == 1
    text = texts.pop()
    assert f"{TIE}: `amax_history`, `underflow_target` kept training equally healthy" in text
    assert "healthiest" not in text
    summary, ranks = _board(list(over), over)
    summary.loc[1, "act_zero_frac_mean_mean"] += 1e-7  # below the 0.1% the verdict writes
    assert f"{TIE}: `amax_history`, `underflow_target`" in overall_verdict(summary, ranks)
    summary.loc[1, "act_zero_frac_mean_mean"] += 0.01
    assert "`amax_history` kept training healthiest" in overall_verdict(summary, ranks)
    over = {"amax_history": 0.30, "underflow_target": np.nan}
    assert f"{TIE}: `amax_history`, `underflow_target`" in overall_verdict(*_board(list(over), over))


def _loss_readings(readings: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame([{"workload": "w", "precision": "fp16", "strategy": s, "baseline": "native",
                          "metric": "final_primary", "reading": r} for s, r in readings.items()])


def test_the_verdict_says_plainly_when_nothing_beats_gradscaler_and_a_lone_control_crowns_nobody() -> None:
    """issue 30: 'Overall, `none` kept training healthiest' came from bf16 cells where `none` ran
    alone (top tier by default) and from readings of too few seeds counted as beating `native`."""
    order = ["none", "native", "static"]
    summary, ranks = _board(order, {s: 0.0 for s in order})
    summary.loc[summary["strategy"] == "native", "skipped_steps_mean"] = 2.0
    ranks.loc[ranks["strategy"] == "native", "rank"] = 2
    alone = pd.DataFrame([{**summary.iloc[0].to_dict(), "precision": "bf16"} for _ in range(3)]).assign(
        workload=["a", "b", "c"])  # three bf16 cells with `none` alone
    ranks_alone = pd.DataFrame({"workload": ["a", "b", "c"], "precision": "bf16", "strategy": "none", "rank": 1})
    text = overall_verdict(pd.concat([summary, alone]), pd.concat([ranks, ranks_alone]),
                           _loss_readings({"none": BETTER_FEW, "static": NO_DIFFERENCE}))
    assert text.startswith("**Verdict:** nothing beat `native` (torch's GradScaler) on primary metric")
    assert "too few seeds to call: `none`" in text and "keep `native`" in text
    assert "top tier for primary metric in 1 of 1" in text  # the lone bf16 cells are not counted
    clear = overall_verdict(summary, ranks, _loss_readings({"static": CLEARLY_BETTER, "none": NO_DIFFERENCE}))
    assert clear.startswith("**Verdict:** beating `native` on primary metric in at least one comparison: `static`.")
