"""The verdict: which strategy kept training healthiest, per workload × precision and overall,
in words the numbers support (see README, "Read the report")."""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.schema import PRIMARY_BETTER

from analysis.metrics import (ACT_ZERO_FRAC, FINAL_PRIMARY, PRIMARY, SKIPPED_STEPS,
                              STRATEGY_OVERHEAD, primary_name)
from analysis.paired import min_wilcoxon_p
from analysis.tables import BASELINE
from analysis.targets import REFERENCE_PRECISION
from analysis.text import code, fmt, fmt_ci, fmt_p, pct
from analysis.words import (BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE, TOO_FEW,
                            NOT_COMPARABLE, PHRASES, TIE, WORSE_FEW)

__all__ = ["cell_verdict", "comparison", "evidence", "overall_verdict", "phrase", "primary_words"]

LOSS = FINAL_PRIMARY.label


def phrase(reading: str, baseline: str = BASELINE) -> str:
    """The sentence for a paired ``reading`` (:func:`analysis.paired.reading`) against
    ``baseline``."""
    return PHRASES.get(reading, reading).format(b=baseline)


def comparison(comps: pd.DataFrame, workload: str, precision: str, strategy: str,
               metric: str = PRIMARY, baseline: str = BASELINE) -> pd.Series | None:
    """The row of ``comps`` for one comparison, or ``None``."""
    c = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
              & (comps["strategy"] == strategy) & (comps["metric"] == metric)
              & (comps["baseline"] == baseline)]
    return None if c.empty else c.iloc[0]


def evidence(c: pd.Series) -> str:
    """``n seeds paired: Δ = … [lo, hi], P(lower) = …, t p (Holm) = …, Wilcoxon p = …``."""
    return (f"{int(c.n_pairs)} paired seeds: Δ = "
            f"{fmt_ci(c.paired_diff, c.paired_diff_lo, c.paired_diff_hi)}, P(lower) = "
            f"{fmt_ci(c.p_better, c.p_better_lo, c.p_better_hi, prob_=True)}, paired t p "
            f"(Holm) = {fmt_p(c.paired_t_p_holm)}, Wilcoxon p = {fmt_p(c.wilcoxon_p)}")


def primary_words(row: pd.Series) -> str:
    """The primary metric of a summary row's workload in words: ``primary metric (−final
    reward)`` where the workload declared one (``experiments.schema.PRIMARY_BETTER``)."""
    name = row.get("primary")
    if not isinstance(name, str) or name not in PRIMARY_BETTER:
        return LOSS
    return f"{LOSS} ({primary_name(name, PRIMARY_BETTER[name] == 'higher')})"


def cell_verdict(workload: str, precision: str, ranks: pd.DataFrame, summary: pd.DataFrame,
                  comps: pd.DataFrame) -> str:
    """One paragraph for a workload × precision: the top tier on the primary metric, its paired
    readings against ``native`` and fp32, who read worse, other clear differences, the cost, and
    the runs that did not finish."""
    cell_s = summary[(summary["workload"] == workload) & (summary["precision"] == precision)]
    cell_r = ranks[(ranks["workload"] == workload) & (ranks["precision"] == precision)]
    ranked = cell_r.dropna(subset=["rank"])
    where = f"**{code(workload)} at {code(precision)}**"
    if ranked.empty:
        return f"{where}: no strategy finished a run — see the run-status table."
    top = ranked[ranked["rank"] == ranked["rank"].min()]["strategy"].tolist()
    row = lambda s: cell_s[cell_s["strategy"] == s].iloc[0]  # noqa: E731
    parts = []
    names = ", ".join(code(s) for s in top)
    lead = row(top[0])
    loss = fmt_ci(lead[f"{PRIMARY}_mean"], lead[f"{PRIMARY}_mean_lo"], lead[f"{PRIMARY}_mean_hi"])
    what = primary_words(lead)
    if len(top) == 1:
        parts.append(f"{where}: {code(top[0])} reached the lowest {what}, {loss} "
                     f"(mean [95% CI], {int(lead[f'{PRIMARY}_n'])} seeds).")
    else:
        parts.append(f"{where}: {names} are tied for the lowest {what} (their 95% "
                     f"intervals overlap; best mean {loss}).")
    for s in top:
        c = comparison(comps, workload, precision, s)
        if s != BASELINE and c is not None:
            parts.append(f"{code(s)} vs `{BASELINE}`: {phrase(c.reading)} ({evidence(c)}).")
        r = comparison(comps, workload, precision, s, baseline=REFERENCE_PRECISION)
        if r is not None and r.reading != NOT_COMPARABLE:
            parts.append(f"{code(s)} vs the fp32 run of the same seed: "
                         f"{phrase(r.reading, REFERENCE_PRECISION)} ({evidence(r)}).")
    worse = []
    for s in ranked["strategy"]:
        c = comparison(comps, workload, precision, s)
        if s not in top and c is not None and c.reading in (CLEARLY_WORSE, WORSE_FEW):
            worse.append(f"{code(s)} ({phrase(c.reading)}; {evidence(c)})")
    if worse:
        parts.append(f"Worse than `{BASELINE}` on {LOSS}: " + ", ".join(worse) + ".")
    others = []
    for m in (ACT_ZERO_FRAC, SKIPPED_STEPS):
        rows = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
                     & (comps["metric"] == m.column) & (comps["baseline"] == BASELINE)]
        for _, c in rows.iterrows():
            if c.reading in (CLEARLY_BETTER, CLEARLY_WORSE):
                f = pct if m.pct else fmt
                more = "fewer" if c.reading == CLEARLY_BETTER else "more"
                others.append(f"{code(c.strategy)} {more} {m.noun} ({f(c['mean'])} vs "
                              f"{f(c.base_mean)})")
    if others:
        parts.append(f"Clearly different from `{BASELINE}` besides loss: " + "; ".join(others)
                     + ".")
    costs = []
    for s in dict.fromkeys([*top, BASELINE]):
        if s not in set(cell_s["strategy"]):
            continue
        r = row(s)
        c = "strategy_overhead_frac_mean"
        overhead = fmt_ci(r[c], r[f"{c}_lo"], r[f"{c}_hi"], pct_=True)
        costs.append(f"{code(s)} skipped {fmt(r['skipped_steps_mean'])} steps and spent "
                     f"{overhead} of step time in the strategy")
    if costs:
        parts.append("Cost: " + "; ".join(costs) + ".")
    bad = cell_s[(cell_s["n_diverged"] + cell_s["n_failed"] + cell_s["n_other"]) > 0]
    for _, r in bad.iterrows():
        what = [f"{word} in {int(r[col])}" for col, word in (
            ("n_diverged", "diverged"), ("n_failed", "failed"),
            ("n_other", "stopped otherwise (see Run status)")) if r[col]]
        parts.append(f"{code(r['strategy'])} {' and '.join(what)} of {int(r['n_runs'])} runs.")
    return " ".join(parts)


#: The health criteria of the overall verdict, in order (overhead is not one: wall clock).
_HEALTH = ["diverged", "top", "skipped", "zeros"]


def _board(s_low: pd.DataFrame, tier1: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy: the health criteria (:data:`_HEALTH`) and the overhead (shown
    only), sorted by the criteria, then by name only to fix the row order of a tie."""
    board = pd.DataFrame([{
        "strategy": strat,
        "diverged": int(g["n_diverged"].sum()),
        "top": int((tier1["strategy"] == strat).sum()),
        "skipped": _nanmean(g["skipped_steps_mean"]),
        "zeros": _nanmean(g["act_zero_frac_mean_mean"]),
        "overhead": _nanmean(g["strategy_overhead_frac_mean"]),
    } for strat, g in s_low.groupby("strategy")])
    return board.sort_values([*_HEALTH, "strategy"], ascending=[True, False, True, True, True],
                             na_position="last").reset_index(drop=True)


def _shown(r: pd.Series) -> tuple[object, ...]:
    """The health criteria of one board row as the verdict writes them: rows that read the same
    are a tie (digits below the page's are noise a re-run need not repeat)."""
    return (r["diverged"], r["top"], fmt(r["skipped"]), pct(r["zeros"]))


def _nanmean(col: pd.Series) -> float:
    v = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    v = v[np.isfinite(v)]
    with np.errstate(all="ignore"):
        return float(v.mean()) if v.size else float("nan")


def _opening(comps: pd.DataFrame | None) -> str:
    """The verdict's first words: the strategies clearly better than ``native`` on the primary metric
    in some comparison, or — none being so — that nothing beat it (readings of too few seeds
    named, not counted) and the advice to keep it."""
    if comps is None or comps.empty:
        return ""
    loss = comps[(comps["metric"] == PRIMARY) & (comps["baseline"] == BASELINE)
                 & (comps["precision"] != REFERENCE_PRECISION)]
    winners = sorted(set(loss[loss["reading"] == CLEARLY_BETTER]["strategy"]))
    hints = sorted(set(loss[loss["reading"] == BETTER_FEW]["strategy"]))
    if winners:
        return (f"beating `{BASELINE}` on {LOSS} in at least one comparison: "
                + ", ".join(code(w) for w in winners) + ". Overall, ")
    if not (loss["reading"] != NOT_COMPARABLE).any():
        return ""
    return (f"nothing beat `{BASELINE}` (torch's GradScaler) on {LOSS} in any comparison "
            f"(no paired reading is '{CLEARLY_BETTER}'"
            + (f"; lower in these seeds, but {TOO_FEW} to call: " + ", ".join(code(h) for h in hints)
               if hints else "")
            + f"): keep `{BASELINE}` unless a secondary metric decides. "
            f"Judged only by divergence, {SKIPPED_STEPS.noun} and underflow, ")


def overall_verdict(summary: pd.DataFrame, ranks: pd.DataFrame,
                    comps: pd.DataFrame | None = None) -> str:
    """One paragraph: which strategy keeps training healthiest and at what cost.

    Health, in this order: fewest diverged runs; most often in the top tier of the primary metric
    (over the reduced-precision workload×precision cells where more than one strategy ran: bf16
    runs only ``none`` and would crown it by default); fewest skipped steps; smallest
    activation-gradient zero fraction (the underflow loss scaling exists to prevent). Cost: the
    strategy's share of step time — shown, never a criterion (wall-clock time moves with machine
    load, issue 30). Strategies that read the same on every criterion (as written) tie: the paragraph names them all,
    never the first in some order. When no strategy is clearly better than ``native`` on the
    primary metric in any cell ('better in these seeds, but too few seeds' is named, not counted), the
    paragraph opens by saying so and advises keeping ``native`` — the pick that follows is then
    made by the secondary criteria among strategies the seeds cannot separate (issue 30)."""
    low = ranks[ranks["precision"] != REFERENCE_PRECISION].dropna(subset=["rank"])
    if low.empty:
        return ("**Verdict:** no reduced-precision strategy finished a run, so nothing can be "
                "compared — see the run-status table.")
    # a cell with one strategy (bf16 runs only `none`) ranks nobody against anybody: not counted
    contested = low[low.groupby(["workload", "precision"])["strategy"].transform("nunique") > 1]
    low = contested if not contested.empty else low
    cells = low.groupby(["workload", "precision"]).ngroups
    tier1 = low[low["rank"] == low.groupby(["workload", "precision"])["rank"].transform("min")]
    s_low = summary[summary["precision"] != REFERENCE_PRECISION]
    board = _board(s_low, tier1)
    best = board.iloc[0]
    same = board[[_shown(r) == _shown(best) for _, r in board.iterrows()]]

    text = "**Verdict:** " + _opening(comps)

    def health(r: pd.Series) -> str:
        return (f"top tier for {LOSS} in {r['top']} of {cells}, "
                + ("no diverged run" if r["diverged"] == 0 else f"{r['diverged']} diverged run(s)")
                + f", {fmt(r['skipped'])} {SKIPPED_STEPS.noun} per run, {pct(r['zeros'])} "
                  f"{ACT_ZERO_FRAC.noun}, {STRATEGY_OVERHEAD.label} {pct(r['overhead'])} of step "
                  "time")

    where = f"in this sweep ({cells} workload×precision comparison{'s' if cells != 1 else ''})"
    if len(same) > 1:
        text += (f"{TIE}: " + ", ".join(code(s) for s in same["strategy"]) + " kept training "
                 f"equally healthy {where}, equal on every criterion ({health(best)})")
    else:
        text += f"{code(best['strategy'])} kept training healthiest {where}: {health(best)}"
    base = board[board["strategy"] == BASELINE]
    if not base.empty and BASELINE not in set(same["strategy"]):
        text += f" — `{BASELINE}`: {health(base.iloc[0])}"
    text += "."
    ties = board[(board["top"] == best["top"]) & (board["diverged"] == best["diverged"])
                 & ~board["strategy"].isin(same["strategy"])]
    if not ties.empty:
        text += (" Equally often in the top tier: " + ", ".join(code(s) for s in ties["strategy"])
                 + f" — the order among them comes from {SKIPPED_STEPS.noun} and underflow "
                   f"({STRATEGY_OVERHEAD.label} is wall-clock time: never a criterion).")
    counts = s_low[f"{PRIMARY}_n"]
    n_seeds = int(counts[counts > 0].min()) if (counts > 0).any() else 0
    if 0 < n_seeds < 6:
        text += (f" With only {n_seeds} seeds per strategy every interval here is wide and "
                 "optimistic (with 3 seeds a nominal 95% bootstrap interval covers the true mean "
                 "only about seven times in ten) and the smallest two-sided Wilcoxon "
                 f"signed-rank p over {n_seeds} paired seeds is {min_wilcoxon_p(n_seeds):.2g}: "
                 "a call of 'clearly' then rests on the paired t-test with every seed agreeing; "
                 "read differences that are not large and consistent as unresolved.")
    return text
