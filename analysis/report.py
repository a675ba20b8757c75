"""``scalelab-report RUN_DIR... [--out DIR] [--bench bench.json]`` — the comparison report.

Loads every run under the given sweep directories (:mod:`analysis.load`), computes interval
estimates, comparisons with ``native`` and tiered rankings (:mod:`analysis.stats`), draws the
figures (:mod:`analysis.figures`) and writes into ``--out`` (default ``reports/compare``):

* ``report.md`` and a self-contained ``report.html`` (figures embedded as base64 PNG) — a plain
  verdict first, then tables with intervals, run statuses, figures and method notes;
* ``results.csv`` — one row per workload × precision × strategy (counts by status, every
  metric's mean/IQM with 95 % intervals, rank); ``comparisons.csv`` (each strategy vs native,
  per metric) and ``runs.csv`` (one row per run, failed/diverged/incomplete included);
* ``figures/*.png``.

Prints the path of ``report.html``. Exit code 2 with a one-line error when a directory is
missing or holds no run records.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from analysis import figures as F
from analysis.bench import load_bench
from analysis.document import Document
from analysis.load import RunLoadError, RunSet, load_runs
from analysis.stats import (BASELINE, METRICS, N_BOOT, PRIMARY, SEED, compare_to_baseline,
                            rank_strategies, summarize)

METRIC_BY_COL = {m.column: m for m in METRICS}


# --------------------------------------------------------------------------------------------
# Number formatting
# --------------------------------------------------------------------------------------------

def fmt(x: object, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; ``–`` for missing/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)) or x is pd.NA:
        return "–"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    v = float(x)  # type: ignore[arg-type]
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def fmt_ci(mean: float, lo: float, hi: float, pct: bool = False, prob: bool = False) -> str:
    """``mean [lo, hi]`` (percentages when ``pct``, two decimals when ``prob``)."""
    if pct:
        f = lambda v: "–" if not np.isfinite(v) else f"{100 * v:.1f}%"  # noqa: E731
    elif prob:
        f = lambda v: "–" if not np.isfinite(v) else f"{v:.2f}"  # noqa: E731
    else:
        f = fmt
    if not np.isfinite(mean):
        return "–"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{f(mean)} [no CI]"
    return f"{f(mean)} [{f(lo)}, {f(hi)}]"


def fmt_p(p: float) -> str:
    if p is None or not np.isfinite(p):
        return "–"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _s(x: object) -> str:
    """A label cell: ``?`` for a missing value (a run whose identity is unknown)."""
    return "?" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)


def _human(n: float) -> str:
    """1000000 → ``1M`` (parameter counts)."""
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:g}{suffix}"
    return f"{n:g}"


def _is_pct(col: str) -> bool:
    return col.endswith("_frac") or col.endswith("_frac_mean")


# --------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------

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


def _cell_verdict(workload: str, precision: str, ranks: pd.DataFrame, summary: pd.DataFrame,
                  comps: pd.DataFrame) -> str:
    cell_s = summary[(summary["workload"] == workload) & (summary["precision"] == precision)]
    cell_r = ranks[(ranks["workload"] == workload) & (ranks["precision"] == precision)]
    ranked = cell_r.dropna(subset=["rank"])
    where = f"**{workload} at {precision}**"
    if ranked.empty:
        return f"{where}: no strategy finished a run — see the run-status table."
    top = ranked[ranked["rank"] == ranked["rank"].min()]["strategy"].tolist()
    row = lambda s: cell_s[cell_s["strategy"] == s].iloc[0]  # noqa: E731
    parts = []
    names = ", ".join(f"`{s}`" for s in top)
    lead = row(top[0])
    loss = fmt_ci(lead[f"{PRIMARY}_mean"], lead[f"{PRIMARY}_mean_lo"], lead[f"{PRIMARY}_mean_hi"])
    if len(top) == 1:
        parts.append(f"{where}: `{top[0]}` reached the lowest final eval loss, {loss} "
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
        parts.append(f"`{s}` vs `{BASELINE}`: {evidence_phrase(c.poi, c.poi_lo, c.poi_hi, c.welch_p, c.mwu_p)} "
                     f"(P(lower loss) = {fmt_ci(c.poi, c.poi_lo, c.poi_hi, prob=True)}, Welch p = "
                     f"{fmt_p(c.welch_p)}, Mann–Whitney p = {fmt_p(c.mwu_p)}).")
    worse = []
    for s in ranked["strategy"]:
        if s in top or s == BASELINE:
            continue
        c = comps[(comps["workload"] == workload) & (comps["precision"] == precision)
                  & (comps["strategy"] == s) & (comps["metric"] == PRIMARY)]
        if not c.empty and np.isfinite(c.iloc[0].poi_hi) and c.iloc[0].poi_hi < 0.5:
            c = c.iloc[0]
            worse.append(f"`{s}` ({fmt(c['mean'])} vs {fmt(c.base_mean)}; P(lower loss) = "
                         f"{fmt_ci(c.poi, c.poi_lo, c.poi_hi, prob=True)})")
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
                f = (lambda v: f"{100 * v:.1f}%") if _is_pct(col) else fmt  # noqa: E731
                others.append(f"`{c.strategy}` {'fewer' if 'better' in phrase else 'more'} "
                              f"{noun} ({f(c['mean'])} vs {f(c.base_mean)})")
    if others:
        parts.append(f"Clearly different from `{BASELINE}` besides loss: " + "; ".join(others)
                     + ".")
    costs = []
    for s in dict.fromkeys([*top, BASELINE]):
        if s not in set(cell_s["strategy"]):
            continue
        r = row(s)
        costs.append(f"`{s}` skipped {fmt(r['skipped_steps_mean'])} steps and spent "
                     f"{fmt_ci(r['strategy_overhead_frac_mean'], r['strategy_overhead_frac_mean_lo'], r['strategy_overhead_frac_mean_hi'], pct=True)} "
                     "of step time in the strategy")
    if costs:
        parts.append("Cost: " + "; ".join(costs) + ".")
    bad = cell_s[(cell_s["n_diverged"] > 0) | (cell_s["n_failed"] > 0)]
    for _, r in bad.iterrows():
        what = []
        if r["n_diverged"]:
            what.append(f"diverged in {int(r['n_diverged'])}")
        if r["n_failed"]:
            what.append(f"failed in {int(r['n_failed'])}")
        parts.append(f"`{r['strategy']}` {' and '.join(what)} of {int(r['n_runs'])} runs.")
    return " ".join(parts)


def _nanmean(col: pd.Series) -> float:
    v = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else float("nan")


def _pct(v: float) -> str:
    return "–" if not np.isfinite(v) else f"{100 * v:.1f}%"


def overall_verdict(summary: pd.DataFrame, ranks: pd.DataFrame,
                    comps: pd.DataFrame | None = None) -> str:
    """One paragraph: which strategy keeps training healthiest and at what cost.

    Health, in this order: fewest diverged runs; most often in the top tier of final eval loss
    (over the reduced-precision workload×precision cells); fewest skipped steps; smallest
    activation-gradient zero fraction (the underflow loss scaling exists to prevent). Cost: the
    strategy's share of step time. When no strategy beat ``native`` on final eval loss in any
    cell (the interval of P(lower loss) above 0.5), the paragraph opens by saying so — the pick
    is then made by the secondary criteria among strategies the seeds cannot separate."""
    low = ranks[ranks["precision"] != F.REFERENCE_PRECISION].dropna(subset=["rank"])
    if low.empty:
        return ("**Verdict:** no reduced-precision strategy finished a run, so nothing can be "
                "compared — see the run-status table.")
    cells = low.groupby(["workload", "precision"]).ngroups
    tier1 = low[low["rank"] == low.groupby(["workload", "precision"])["rank"].transform("min")]
    s_low = summary[summary["precision"] != F.REFERENCE_PRECISION]
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
        loss = comps[(comps["metric"] == PRIMARY) & (comps["precision"] != F.REFERENCE_PRECISION)]
        comparable = bool(np.isfinite(loss["poi_lo"]).any())
        winners = sorted(set(loss[loss["poi_lo"] > 0.5]["strategy"]))
    text = "**Verdict:** "
    if comparable and not winners:
        text += (f"no strategy reached a detectably lower final eval loss than `{BASELINE}` in "
                 "any comparison (every interval of P(lower loss) includes 0.5 or lies below "
                 "it). Judged also by divergence, skipped steps and underflow, ")
    elif winners:
        text += (f"beating `{BASELINE}` on final eval loss in at least one comparison: "
                 + ", ".join(f"`{w}`" for w in winners) + ". Overall, ")

    def health(r: pd.Series) -> str:
        return (f"top tier for final eval loss in {r['top']} of {cells}, "
                + ("no diverged run" if r["diverged"] == 0 else f"{r['diverged']} diverged run(s)")
                + f", {fmt(r['skipped'])} skipped steps per run, {_pct(r['zeros'])} "
                  f"activation-gradient zeros, strategy overhead {_pct(r['overhead'])} of step time")

    text += (f"`{best['strategy']}` kept training healthiest in this sweep "
             f"({cells} workload×precision comparison{'s' if cells != 1 else ''}): {health(best)}")
    base = board[board["strategy"] == BASELINE]
    if not base.empty and best["strategy"] != BASELINE:
        text += f" — `{BASELINE}`: {health(base.iloc[0])}"
    text += "."
    ties = board[(board["top"] == best["top"]) & (board["diverged"] == best["diverged"])
                 & (board["strategy"] != best["strategy"])]
    if not ties.empty:
        text += (" Equally often in the top tier: " + ", ".join(f"`{s}`" for s in ties["strategy"])
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


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

def _ranking_rows(summary: pd.DataFrame, ranks: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    merged = summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with"]],
                           on=["workload", "precision", "strategy"], how="left")
    merged = merged.sort_values(["workload", "precision", "rank", f"{PRIMARY}_mean", "strategy"],
                                na_position="last")
    cols = ["workload", "precision", "rank", "strategy", "runs ok/div/fail/inc",
            "final eval loss mean [95% CI]", "IQM [95% CI]", "skipped steps", "strategy overhead",
            "act-grad zero frac"]
    rows = []
    for _, r in merged.iterrows():
        c = PRIMARY
        rows.append([
            _s(r["workload"]), _s(r["precision"]),
            "–" if pd.isna(r["rank"]) else str(int(r["rank"])) + ("=" if r["tied_with"] else ""),
            f"`{r['strategy']}`",
            f"{r['n_completed']}/{r['n_diverged']}/{r['n_failed']}/{r['n_incomplete']}",
            fmt_ci(r[f"{c}_mean"], r[f"{c}_mean_lo"], r[f"{c}_mean_hi"]),
            fmt_ci(r[f"{c}_iqm"], r[f"{c}_iqm_lo"], r[f"{c}_iqm_hi"]),
            fmt_ci(r["skipped_steps_mean"], r["skipped_steps_mean_lo"], r["skipped_steps_mean_hi"]),
            fmt_ci(r["strategy_overhead_frac_mean"], r["strategy_overhead_frac_mean_lo"],
                   r["strategy_overhead_frac_mean_hi"], pct=True),
            fmt_ci(r["act_zero_frac_mean_mean"], r["act_zero_frac_mean_mean_lo"],
                   r["act_zero_frac_mean_mean_hi"], pct=True),
        ])
    return cols, rows


def _comparison_rows(comps: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    cols = ["workload", "precision", "strategy", "metric", "mean (native)", "Δ mean",
            "P(X better) [95% CI]", "Welch p", "Mann–Whitney p", "reading"]
    rows = []
    for _, r in comps.iterrows():
        pct = _is_pct(r["metric"])
        m = METRIC_BY_COL[r["metric"]].label if r["metric"] in METRIC_BY_COL else r["metric"]
        f = (lambda v: "–" if not np.isfinite(v) else f"{100 * v:.2f}%") if pct else fmt
        rows.append([
            str(r["workload"]), str(r["precision"]), f"`{r['strategy']}`", m,
            f"{f(r['mean'])} ({f(r['base_mean'])})",
            ("+" if np.isfinite(r["diff"]) and r["diff"] > 0 else "") + f(r["diff"]),
            fmt_ci(r["poi"], r["poi_lo"], r["poi_hi"], prob=True), fmt_p(r["welch_p"]), fmt_p(r["mwu_p"]),
            evidence_phrase(r["poi"], r["poi_lo"], r["poi_hi"], r["welch_p"], r["mwu_p"])
            .replace("native", f"`{BASELINE}`"),
        ])
    return cols, rows


def _status_rows(rs: RunSet) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    runs = rs.runs
    counts = (runs.assign(strategy=runs["strategy"].fillna("?"),
                          precision=runs["precision"].fillna("?"),
                          workload=runs["workload"].fillna("?"))
              .groupby(["workload", "precision", "strategy", "status"]).size()
              .unstack(fill_value=0))
    statuses = ["completed", "diverged", "failed", "incomplete"]
    counts = counts.reindex(columns=statuses, fill_value=0)
    c_cols = ["workload", "precision", "strategy", *statuses]
    c_rows = [[w, p, f"`{s}`", *[str(int(v)) for v in vals]]
              for (w, p, s), vals in zip(counts.index, counts.to_numpy())]
    bad = runs[runs["status"] != "completed"]
    b_cols = ["run", "status", "strategy", "precision", "seed", "steps", "last loss / reason"]
    b_rows = []
    last_loss = rs.train.groupby("run_id")["loss"].last() if not rs.train.empty else pd.Series()
    for _, r in bad.iterrows():
        reason = r["error"] if isinstance(r["error"], str) and r["error"] else ""
        if r["status"] == "diverged":
            reason = (reason + " " if reason else "") + f"last logged loss {fmt(last_loss.get(r['run_id'], np.nan))}"
        b_rows.append([f"`{r['run_id']}`", f"**{r['status']}**", _s(r["strategy"]),
                       _s(r["precision"]), fmt(r["seed"]) if pd.notna(r["seed"]) else "–",
                       fmt(r["steps"]) if pd.notna(r["steps"]) else "–", reason or "–"])
    return c_cols, c_rows, b_cols, b_rows


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def results_table(summary: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """``results.csv``: the summary with rank and tie columns, one row per group."""
    return summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with",
                                "diverged_frac"]],
                         on=["workload", "precision", "strategy"], how="left")


def build_report(run_dirs: Sequence[str | Path], out: str | Path, bench: str | Path | None = None,
                 *, n_boot: int = N_BOOT) -> Path:
    """Write the report for ``run_dirs`` into ``out``; return the path of ``report.html``.

    Raises :class:`analysis.load.RunLoadError` for a missing/empty directory.
    """
    rs = load_runs(list(run_dirs))
    out = Path(out)
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    for old in fig_dir.glob("*.png"):  # a regenerated report never shows stale figures
        old.unlink()
    summary = summarize(rs.runs, n_boot=n_boot)
    comps = compare_to_baseline(rs.runs, n_boot=n_boot)
    ranks = rank_strategies(summary)
    bench_df, bench_note = load_bench(bench)

    results_table(summary, ranks).to_csv(out / "results.csv", index=False)
    comps.to_csv(out / "comparisons.csv", index=False)
    rs.runs.to_csv(out / "runs.csv", index=False)

    doc = Document("scalelab comparison report")
    n_status = rs.runs["status"].value_counts()
    doc.p(f"{len(rs.runs)} runs from {', '.join(f'`{s}`' for s in rs.sources)} — "
          + ", ".join(f"{int(n_status.get(s, 0))} {s}" for s in
                      ("completed", "diverged", "failed", "incomplete"))
          + f". Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.")

    doc.h(1, "Verdict")
    doc.p(overall_verdict(summary, ranks, comps))
    cells = (ranks[ranks["precision"] != F.REFERENCE_PRECISION][["workload", "precision"]]
             .dropna().drop_duplicates().sort_values(["workload", "precision"]))
    doc.bullets([_cell_verdict(w, p, ranks, summary, comps) for w, p in cells.to_numpy()])

    doc.h(1, "Ranking and final metrics")
    cols, rows = _ranking_rows(summary, ranks)
    doc.table(cols, rows, caption=(
        "Per workload × precision × strategy, over seeds: mean [95% percentile-bootstrap CI]. "
        "Rank on final eval loss; `=` marks a tie (intervals overlap); a strategy with any "
        "diverged run ranks below those without. Runs: completed/diverged/failed/incomplete — "
        "statistics use completed runs only. Lower is better in every column."))

    doc.h(1, f"Each strategy against {BASELINE}")
    if comps.empty:
        doc.p(f"No workload×precision cell has both `{BASELINE}` and another strategy.")
    else:
        cols, rows = _comparison_rows(comps)
        doc.table(cols, rows, caption=(
            "P(X better): probability that a run of the strategy has a lower value than a run "
            f"of `{BASELINE}` (0.5 = no difference), with a 95% bootstrap CI; for the final eval "
            "loss a diverged run counts as worse than any finished run. Welch's t-test and "
            "Mann–Whitney U are two-sided."))

    if bench_df is not None:
        doc.h(1, "Strategy overhead by model size (scalelab-bench)")
        sizes = sorted(bench_df["size"].unique())
        rows = []
        for name, g in bench_df.groupby("name", sort=True):
            by = g.set_index("size")
            rows.append([f"`{name}`"] + [
                "–" if sz not in by.index else
                f"{fmt(by.loc[sz, 'median_ms'])} ms" + (
                    f" ({by.loc[sz, 'ratio_vs_gradscaler']:.2f}×)"
                    if np.isfinite(by.loc[sz, "ratio_vs_gradscaler"]) else "")
                for sz in sizes])
        doc.table(["strategy", *[f"{_human(sz)} params" for sz in sizes]], rows, caption=(
            "Median time per step of the strategy alone (scale + unscale_ + step + update, no-op "
            "optimizer) and, in brackets, its ratio to torch.amp.GradScaler at the same size."))

    doc.h(1, "Run status")
    c_cols, c_rows, b_cols, b_rows = _status_rows(rs)
    doc.table(c_cols, c_rows, caption="Every run found, by status. Nothing is dropped.")
    if b_rows:
        doc.table(b_cols, b_rows, caption="Runs that did not complete normally.")
    else:
        doc.p("Every run completed.")
    if rs.problems:
        doc.p(f"**Data problems** ({len(rs.problems)}), skipped while loading:")
        doc.bullets([f"`{p}`" for p in rs.problems[:50]]
                    + ([f"… and {len(rs.problems) - 50} more"] if len(rs.problems) > 50 else []))

    doc.h(1, "Figures")
    figs = F.all_figures(rs, summary, bench_df)
    try:
        for f in figs:
            path = fig_dir / f"{f.name}.png"
            f.fig.savefig(path, dpi=110)
            doc.h(2, f.title)
            doc.image(path, f.title, f.caption)
    finally:
        F.close_all(figs)
    if bench_note:
        doc.p(bench_note + ".")

    doc.h(1, "Method")
    doc.bullets([
        "Unit of comparison: workload (`model/data/regime`) × precision; one value per run (seed).",
        f"Intervals: 95% percentile bootstrap over seeds, {n_boot} resamples, RNG seed {SEED} "
        "(reproducible). The percentile bootstrap under-covers for few seeds: nominal 95% is "
        "about 75% with 3 seeds, about 93% with 20.",
        "IQM: mean of the middle 50% of runs (scipy `trim_mean(x, 0.25)`); equals the mean below "
        "4 runs.",
        f"Comparisons with `{BASELINE}`: Welch's unequal-variance t-test; two-sided Mann–Whitney U "
        "(exact without ties; ≥ 0.1 for 3 vs 3); probability of improvement (rliable) with a "
        "bootstrap CI resampling each side independently.",
        "Ranking: by fraction of diverged runs, then mean final eval loss; tied while the 95% "
        "intervals overlap the tier leader's.",
        "Metrics: " + "; ".join(f"**{m.label}** — {m.description}" for m in METRICS) + ".",
    ])

    (out / "report.md").write_text(doc.to_markdown(out), encoding="utf-8")
    html_path = out / "report.html"
    html_path.write_text(doc.to_html(), encoding="utf-8")
    return html_path


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``scalelab-report``."""
    parser = argparse.ArgumentParser(
        prog="scalelab-report",
        description="Write a comparison report (Markdown, self-contained HTML, CSV, figures) "
                    "for one or more sweep directories.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="sweep (multirun) or run directory; searched recursively")
    parser.add_argument("--out", default="reports/compare", help="output folder "
                        "(default: reports/compare)")
    parser.add_argument("--bench", default=None, help="scalelab-bench JSON for the "
                        "overhead-vs-size figure (optional)")
    parser.add_argument("--n-boot", type=int, default=N_BOOT, help=f"bootstrap resamples "
                        f"(default {N_BOOT})")
    args = parser.parse_args(argv)
    if args.n_boot < 1:
        print(f"scalelab-report: error: --n-boot must be >= 1, got {args.n_boot}", file=sys.stderr)
        return 2
    try:
        path = build_report(args.run_dirs, args.out, args.bench, n_boot=args.n_boot)
    except RunLoadError as exc:
        print(f"scalelab-report: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
