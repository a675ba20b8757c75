"""The verdict: which strategy kept training healthiest, per workload × precision and overall,
in words the numbers support (see README, "Read the report")."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.tables import BASELINE, PRIMARY, REFERENCE_PRECISION
from analysis.text import code, fmt, fmt_ci, fmt_p, is_pct, pct


def evidence_phrase(poi: float, lo: float, hi: float, p_welch: float, p_mwu: float) -> str:
    """Confidence language for "X vs native" that the numbers support.

    * interval of P(improvement) above 0.5 and a test with p < 0.05 → "clearly better";
    * interval above 0.5 but no test below 0.05 → "better in every resample of these seeds,
      but too few seeds for a significant test";
    * interval straddles 0.5 → "no detectable difference";
    * interval below 0.5 (mirror cases) → "clearly worse" / "worse ... too few seeds".
    """
    if not np.isfinite(poi):
        return "not comparable (too few finished runs)"
    sig = any(np.isfinite(p) and p < 0.05 for p in (p_welch, p_mwu))
    if np.isfinite(lo) and lo > 0.5:
        return "clearly better than native" if sig else \
            "better than native in these seeds, but too few seeds for a significant test"
    if np.isfinite(hi) and hi < 0.5:
        return "clearly worse than native" if sig else \
            "worse than native in these seeds, but too few seeds for a significant test"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not testable (fewer than 2 finished runs on a side)"
    return "no detectable difference from native"


def cell_verdict(workload: str, precision: str, ranks: pd.DataFrame, summary: pd.DataFrame,
                  comps: pd.DataFrame) -> str:
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
    if len(top) == 1:
        parts.append(f"{where}: {code(top[0])} reached the lowest final eval loss, {loss} "
                     f"(mean [95% CI], {int(lead[f'{PRIMARY}_n'])} seeds).")
    else:
        parts.append(f"{where}: {names} are tied for the lowest final eval loss (their 95% "
                     f"intervals overlap; best mean {loss}).")
    for s in top:
        if s == BASELINE:
            continue
        c = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
                  & (comps["strategy"] == s) & (comps["metric"] == PRIMARY)]
        if c.empty:
            continue
        c = c.iloc[0]
        parts.append(f"{code(s)} vs `{BASELINE}`: {evidence_phrase(c.poi, c.poi_lo, c.poi_hi, c.welch_p, c.mwu_p)} "
                     f"(P(lower loss) = {fmt_ci(c.poi, c.poi_lo, c.poi_hi, prob_=True)}, Welch p = "
                     f"{fmt_p(c.welch_p)}, Mann–Whitney p = {fmt_p(c.mwu_p)}).")
    worse = []
    for s in ranked["strategy"]:
        if s in top or s == BASELINE:
            continue
        c = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
                  & (comps["strategy"] == s) & (comps["metric"] == PRIMARY)]
        if not c.empty and np.isfinite(c.iloc[0].poi_hi) and c.iloc[0].poi_hi < 0.5:
            c = c.iloc[0]
            worse.append(f"{code(s)} ({fmt(c['mean'])} vs {fmt(c.base_mean)}; P(lower loss) = "
                         f"{fmt_ci(c.poi, c.poi_lo, c.poi_hi, prob_=True)})")
    if worse:
        parts.append(f"Worse than `{BASELINE}` on final eval loss in every resample: "
                     + ", ".join(worse) + ".")
    others = []
    for col, noun in (("act_zero_frac_mean", "activation-gradient zeros"),
                      ("skipped_steps", "skipped steps")):
        rows = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
                     & (comps["metric"] == col)]
        for _, c in rows.iterrows():
            phrase = evidence_phrase(c.poi, c.poi_lo, c.poi_hi, c.welch_p, c.mwu_p)
            if phrase.startswith("clearly"):
                f = (lambda v: f"{100 * v:.1f}%") if is_pct(col) else fmt  # noqa: E731
                others.append(f"{code(c.strategy)} {'fewer' if 'better' in phrase else 'more'} "
                              f"{noun} ({f(c['mean'])} vs {f(c.base_mean)})")
    if others:
        parts.append(f"Clearly different from `{BASELINE}` besides loss: " + "; ".join(others)
                     + ".")
    costs = []
    for s in dict.fromkeys([*top, BASELINE]):
        if s not in set(cell_s["strategy"]):
            continue
        r = row(s)
        costs.append(f"{code(s)} skipped {fmt(r['skipped_steps_mean'])} steps and spent "
                     f"{fmt_ci(r['strategy_overhead_frac_mean'], r['strategy_overhead_frac_mean_lo'], r['strategy_overhead_frac_mean_hi'], pct_=True)} "
                     "of step time in the strategy")
    if costs:
        parts.append("Cost: " + "; ".join(costs) + ".")
    bad = cell_s[(cell_s["n_diverged"] + cell_s["n_failed"] + cell_s["n_other"]) > 0]
    for _, r in bad.iterrows():
        what = [f"{word} in {int(r[col])}" for col, word in (
            ("n_diverged", "diverged"), ("n_failed", "failed"),
            ("n_other", "stopped otherwise (see Run status)")) if r[col]]
        parts.append(f"{code(r['strategy'])} {' and '.join(what)} of {int(r['n_runs'])} runs.")
    return " ".join(parts)


def _nanmean(col: pd.Series) -> float:
    v = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    v = v[np.isfinite(v)]
    with np.errstate(all="ignore"):
        return float(v.mean()) if v.size else float("nan")


def overall_verdict(summary: pd.DataFrame, ranks: pd.DataFrame,
                    comps: pd.DataFrame | None = None) -> str:
    """One paragraph: which strategy keeps training healthiest and at what cost.

    Health, in this order: fewest diverged runs; most often in the top tier of final eval loss
    (over the reduced-precision workload×precision cells); fewest skipped steps; smallest
    activation-gradient zero fraction (the underflow loss scaling exists to prevent). Cost: the
    strategy's share of step time. When no strategy beat ``native`` on final eval loss in any
    cell (the interval of P(lower loss) above 0.5), the paragraph opens by saying so — the pick
    is then made by the secondary criteria among strategies the seeds cannot separate."""
    low = ranks[ranks["precision"] != REFERENCE_PRECISION].dropna(subset=["rank"])
    if low.empty:
        return ("**Verdict:** no reduced-precision strategy finished a run, so nothing can be "
                "compared — see the run-status table.")
    cells = low.groupby(["workload", "precision"]).ngroups
    tier1 = low[low["rank"] == low.groupby(["workload", "precision"])["rank"].transform("min")]
    s_low = summary[summary["precision"] != REFERENCE_PRECISION]
    board = pd.DataFrame([{
        "strategy": strat,
        "diverged": int(g["n_diverged"].sum()),
        "top": int((tier1["strategy"] == strat).sum()),
        "skipped": _nanmean(g["skipped_steps_mean"]),
        "zeros": _nanmean(g["act_zero_frac_mean_mean"]),
        "overhead": _nanmean(g["strategy_overhead_frac_mean"]),
    } for strat, g in s_low.groupby("strategy")])
    board = board.sort_values(["diverged", "top", "skipped", "zeros", "overhead"],
                              ascending=[True, False, True, True, True], na_position="last")
    best = board.iloc[0]

    winners: list[str] = []
    comparable = False
    if comps is not None and not comps.empty:
        loss = comps[(comps["metric"] == PRIMARY) & (comps["precision"] != REFERENCE_PRECISION)]
        comparable = bool(np.isfinite(loss["poi_lo"]).any())
        winners = sorted(set(loss[loss["poi_lo"] > 0.5]["strategy"]))
    text = "**Verdict:** "
    if comparable and not winners:
        text += (f"no strategy reached a detectably lower final eval loss than `{BASELINE}` in "
                 "any comparison (every interval of P(lower loss) includes 0.5 or lies below "
                 "it). Judged also by divergence, skipped steps and underflow, ")
    elif winners:
        text += (f"beating `{BASELINE}` on final eval loss in at least one comparison: "
                 + ", ".join(code(w) for w in winners) + ". Overall, ")

    def health(r: pd.Series) -> str:
        return (f"top tier for final eval loss in {r['top']} of {cells}, "
                + ("no diverged run" if r["diverged"] == 0 else f"{r['diverged']} diverged run(s)")
                + f", {fmt(r['skipped'])} skipped steps per run, {pct(r['zeros'])} "
                  f"activation-gradient zeros, strategy overhead {pct(r['overhead'])} of step time")

    text += (f"{code(best['strategy'])} kept training healthiest in this sweep "
             f"({cells} workload×precision comparison{'s' if cells != 1 else ''}): {health(best)}")
    base = board[board["strategy"] == BASELINE]
    if not base.empty and best["strategy"] != BASELINE:
        text += f" — `{BASELINE}`: {health(base.iloc[0])}"
    text += "."
    ties = board[(board["top"] == best["top"]) & (board["diverged"] == best["diverged"])
                 & (board["strategy"] != best["strategy"])]
    if not ties.empty:
        text += (" Equally often in the top tier: " + ", ".join(code(s) for s in ties["strategy"])
                 + " — the order among them comes from skipped steps, underflow and overhead.")
    counts = s_low[f"{PRIMARY}_n"]
    n_seeds = int(counts[counts > 0].min()) if (counts > 0).any() else 0
    if 0 < n_seeds < 5:
        p_min = 2 / math.comb(2 * n_seeds, n_seeds)
        text += (f" With only {n_seeds} seeds per strategy every interval here is wide and "
                 "optimistic (with 3 seeds a nominal 95% percentile-bootstrap interval covers the "
                 "true mean only about three times in four) and the smallest two-sided "
                 f"Mann–Whitney p for {n_seeds} vs {n_seeds} runs is {p_min:.2g}: read "
                 "differences that are not large and consistent as unresolved.")
    return text
