"""``scalelab-report RUN_DIR... [--out DIR] [--bench bench.json]`` — the comparison report.

Loads every run under the given sweep directories (:mod:`analysis.load`), computes interval
estimates, comparisons with ``native`` and tiered rankings (:mod:`analysis.stats`), draws the
figures (:mod:`analysis.figures`) and writes into ``--out`` (default ``reports/compare``):

* ``report.md`` and a self-contained ``report.html`` (figures embedded as base64 PNG) — a plain
  verdict first, then tables with intervals, run statuses, figures and method notes;
* ``results.csv`` — one row per workload × precision × strategy (counts by status, every
  metric's mean/IQM with 95 % intervals, rank); ``comparisons.csv`` (each strategy vs native,
  per metric, and vs the fp32 run of the same seed on final eval loss), ``runs.csv`` (one row
  per run, failed/diverged/incomplete included, with ``steps_to_target``) and
  ``which_strategy_when.csv`` (per regime × precision: the best strategy, its paired effects
  and why; :mod:`analysis.when`), also the first table of the verdict, and
  ``cross_workload.csv`` (per strategy across workloads: AlgoPerf's score B, rliable's IQM and
  P(improvement vs native), with intervals; :mod:`analysis.profiles`), the second;
* ``figures/*.png``.

Prints the path of ``report.html``, and each bad record (a file or directory that could not be
read, or only in part, or held bad values; :attr:`analysis.runset.RunSet.problems`) on stderr as
``scalelab-report: bad record: <path>: <reason>``; they are listed in the report too. Exit code
2 with a one-line error when a directory is missing or holds no run records. Reading is bounded
per file and in all (``docs/report.md``, "Any directory tree"); CSV cells that a spreadsheet
would run as formulas are made inert (:func:`analysis.text.write_csv`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from analysis import figures as F
from analysis.bench import load_bench
from analysis.document import Document, write_document
from analysis.findings import findings_page
from analysis.load import RunLoadError, RunSet, load_runs
from analysis.metrics import (ACT_ZERO_FRAC, FINAL_EVAL_LOSS, METRICS, PRIMARY, SKIPPED_STEPS,
                              STEPS_TO_TARGET, STRATEGY_OVERHEAD, metric)
from analysis.records import STATUSES
from analysis.stats import N_BOOT, SEED
from analysis.tables import (BASELINE, compare_to_baseline, compare_to_reference, rank_strategies,
                             summarize)
from analysis.targets import REFERENCE_PRECISION
from analysis.text import code, fmt, fmt_ci, fmt_p, human, pct, write_csv
from analysis.verdict import cell_verdict, overall_verdict, phrase
from analysis.when import (CROSS_CAPTION, cross_rows, cross_verdict, cross_workload_table,
                           order_text, table_rows, which_strategy_when)
from analysis.words import CLEARLY_BETTER, CLEARLY_WORSE, TOO_FEW

LOSS = FINAL_EVAL_LOSS.label


def _ranking_rows(summary: pd.DataFrame, ranks: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    merged = summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with"]],
                           on=["workload", "precision", "strategy"], how="left")
    merged = merged.sort_values(["workload", "precision", "rank", f"{PRIMARY}_mean", "strategy"],
                                na_position="last")
    shown = (SKIPPED_STEPS, STRATEGY_OVERHEAD, ACT_ZERO_FRAC)
    cols = ["workload", "precision", "rank", "strategy", "runs ok/div/fail/inc",
            f"{LOSS} mean [95% CI]", "IQM [95% CI]",
            f"{STEPS_TO_TARGET.label} ({STEPS_TO_TARGET.unit})", *(m.label for m in shown)]
    rows = []
    for _, r in merged.iterrows():
        c = PRIMARY
        rows.append([
            code(r["workload"]), code(r["precision"]),
            "–" if pd.isna(r["rank"]) else str(int(r["rank"])) + ("=" if r["tied_with"] else ""),
            code(r["strategy"]),
            f"{r['n_completed']}/{r['n_diverged']}/{r['n_failed']}/{r['n_incomplete']}",
            fmt_ci(r[f"{c}_mean"], r[f"{c}_mean_lo"], r[f"{c}_mean_hi"]),
            fmt_ci(r[f"{c}_iqm"], r[f"{c}_iqm_lo"], r[f"{c}_iqm_hi"]),
            _reached(r),
            *(fmt_ci(r[f"{m.column}_mean"], r[f"{m.column}_mean_lo"], r[f"{m.column}_mean_hi"],
                     pct_=m.pct) for m in shown),
        ])
    return cols, rows


def _reached(r: pd.Series) -> str:
    """Mean time to target [95% CI] over the completed runs that reached it, and how many."""
    c = STEPS_TO_TARGET.column
    if f"{c}_n" not in r or not r["n_completed"]:
        return "–"
    return (f"{fmt_ci(r[f'{c}_mean'], r[f'{c}_mean_lo'], r[f'{c}_mean_hi'])}; reached in "
            f"{int(r[f'{c}_n'])} of {int(r['n_completed'])}")


PAIRED_CAPTION = (
    "Paired by seed (runs of one seed share init and data order): Δ = strategy − {b} per seed, "
    "mean with its 95% bootstrap CI (negative is better); P(lower) = fraction of seeds where "
    f"the strategy is lower, with a Clopper–Pearson CI; for the {LOSS} a diverged run "
    "loses to any finished one. Reading: see Method. Unpaired statistics: comparisons.csv.")


def _comparison_rows(comps: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    cols = ["workload", "precision", "strategy", "metric", "mean (baseline)", "seeds",
            "Δ per seed [95% CI]", "P(lower) [95% CI]", "paired t p (Holm)", "Wilcoxon p",
            "reading"]
    rows = []
    for _, r in comps.iterrows():
        m = metric(r["metric"])
        f = (lambda v: pct(v, 2)) if m.pct else fmt  # noqa: E731
        rows.append([
            code(r["workload"]), code(r["precision"]), code(r["strategy"]), m.label,
            f"{f(r['mean'])} ({f(r['base_mean'])})", str(int(r["n_pairs"])),
            fmt_ci(r["paired_diff"], r["paired_diff_lo"], r["paired_diff_hi"], pct_=m.pct),
            fmt_ci(r["p_better"], r["p_better_lo"], r["p_better_hi"], prob_=True),
            fmt_p(r["paired_t_p_holm"]), fmt_p(r["wilcoxon_p"]),
            phrase(r["reading"], f"`{r['baseline']}`"),
        ])
    return cols, rows


def _status_rows(rs: RunSet) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """Counts by status (every run, identity unknown as ``?``), and one row per run that did not
    complete normally or whose records had issues, with a one-line reason."""
    runs = rs.runs
    statuses = [*STATUSES, *sorted(set(runs["status"]) - set(STATUSES))]
    keys = ["workload", "precision", "strategy"]
    counts = (runs.assign(**{k: runs[k].fillna("?") for k in keys})
              .groupby([*keys, "status"]).size().unstack(fill_value=0)
              .reindex(columns=statuses, fill_value=0))
    c_cols = [*keys, *statuses]
    c_rows = [[*(code(k) for k in idx), *[str(int(v)) for v in vals]]
              for idx, vals in zip(counts.index, counts.to_numpy())]
    bad = runs[(runs["status"] != "completed") | runs["issues"].notna()]
    b_cols = ["run", "status", "strategy", "precision", "seed", "steps", "last loss / reason"]
    b_rows = []
    last_loss = rs.train.groupby("run_id")["loss"].last() if not rs.train.empty else pd.Series()
    for _, r in bad.iterrows():
        reason = [code(r["error"])] if isinstance(r["error"], str) and r["error"] else []
        if r["status"] == "diverged":
            reason.append(f"last logged loss {fmt(last_loss.get(r['run_id'], np.nan))}")
        if isinstance(r["issues"], str):
            reason.append(code(r["issues"], max_chars=300))
        b_rows.append([code(r["run_id"]), f"**{r['status']}**", code(r["strategy"]),
                       code(r["precision"]), fmt(r["seed"]), fmt(r["steps"]),
                       "; ".join(reason) or "–"])
    return c_cols, c_rows, b_cols, b_rows


def _diagnosis_rows(runs: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """One row per run the doctor looked at (``diagnosis.json``, or the summary's cause):
    run, status, cause, first module, verdict, fix — or why the doctor could not run."""
    cols = ["run", "status", "cause", "first module", "verdict", "fix"]
    rows = []
    seen = runs[runs["diagnosis"].notna() | runs["diagnosis_error"].notna()]
    for _, r in seen.iterrows():
        cause = r["diagnosis"] if isinstance(r["diagnosis"], str) else None
        verdict = r["diagnosis_verdict"] if cause else f"doctor did not run: {r['diagnosis_error']}"
        rows.append([code(r["run_id"]), f"**{r['status']}**", code(cause) if cause else "–",
                     code(r["diagnosis_module"]) if isinstance(r["diagnosis_module"], str) else "–",
                     code(verdict, max_chars=300) if isinstance(verdict, str) else "–",
                     code(r["diagnosis_fix"], max_chars=300)
                     if isinstance(r["diagnosis_fix"], str) else "–"])
    return cols, rows


def results_table(summary: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """``results.csv``: the summary with rank and tie columns, one row per group."""
    return summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with",
                                "diverged_frac"]],
                         on=["workload", "precision", "strategy"], how="left")


def build_report(run_dirs: Sequence[str | Path], out: str | Path, bench: str | Path | None = None,
                 *, n_boot: int = N_BOOT, problems: list[str] | None = None,
                 page: str | Path | None = None, command: str = "scalelab-report") -> Path:
    """Write the report for ``run_dirs`` into ``out``; return the path of ``report.html``.

    ``page``: also write the short findings page there (:mod:`analysis.findings`;
    ``docs/findings.md`` under ``make compare``), naming ``command`` as what wrote it.

    The bad records (:attr:`analysis.runset.RunSet.problems`, one line each) are listed in the
    report and appended to ``problems`` when given. Raises :class:`analysis.load.RunLoadError`
    for a missing/empty directory.
    """
    rs = load_runs(list(run_dirs))
    if problems is not None:
        problems.extend(rs.problems)
    out = Path(out)
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    for old in fig_dir.glob("*.png"):  # a regenerated report never shows stale figures
        old.unlink()
    summary = summarize(rs.runs, n_boot=n_boot)
    comps = pd.concat([compare_to_baseline(rs.runs, n_boot=n_boot),
                       compare_to_reference(rs.runs, n_boot=n_boot)], ignore_index=True)
    ranks = rank_strategies(summary)
    when = which_strategy_when(rs.runs, comps)
    cross, cross_notes = cross_workload_table(rs.runs, rs.train, n_boot=n_boot)
    bench_df, bench_note = load_bench(bench)

    write_csv(results_table(summary, ranks), out / "results.csv")
    write_csv(comps, out / "comparisons.csv")
    write_csv(when, out / "which_strategy_when.csv")
    write_csv(cross, out / "cross_workload.csv")
    write_csv(rs.runs, out / "runs.csv")

    doc = Document("scalelab comparison report")
    n_status = rs.runs["status"].value_counts()
    doc.p(f"{len(rs.runs)} runs from {', '.join(code(s) for s in rs.sources)} — "
          + ", ".join(f"{int(n_status.get(s, 0))} {s}"
                      for s in [*STATUSES, *sorted(set(n_status.index) - set(STATUSES))])
          + f". Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.")

    doc.h(1, "Verdict")
    if not when.empty:
        cols, rows = table_rows(when)
        doc.table(cols, rows, caption=(
            "Which strategy when (which_strategy_when.csv). The verdict reads the metrics in "
            f"this order: {order_text()}. Best = the strategy read *{CLEARLY_BETTER}* than "
            f"`{BASELINE}` (paired by seed) on the earliest of them for which any strategy is, "
            f"the largest mean paired gain among several; one read *{CLEARLY_WORSE}* on an "
            f"earlier metric is not counted. No best where none is {CLEARLY_BETTER}: the row "
            "then says what the paired readings say. Δ = strategy − baseline per seed, mean "
            "[95% CI]; against fp32 it is the final-eval-loss gap to the fp32 run of the same "
            "seed. Cells without `native` (controls) are compared with fp32 only."))
    cross_tables = []
    if not cross.empty:
        cols, rows = cross_rows(cross)
        cross_tables.append((cols, rows, CROSS_CAPTION + "".join(f" {code(n, max_chars=300)}."
                                                                 for n in cross_notes)))
        doc.table(*cross_tables[-1][:2], caption=cross_tables[-1][2])
    cross_text = cross_verdict(cross)
    doc.p(cross_text)
    overall = overall_verdict(summary, ranks, comps)
    cells = (ranks[ranks["precision"] != REFERENCE_PRECISION][["workload", "precision"]]
             .dropna().drop_duplicates().sort_values(["workload", "precision"]))
    cell_lines = [cell_verdict(w, p, ranks, summary, comps) for w, p in cells.to_numpy()]
    doc.p(overall)
    doc.bullets(cell_lines)
    if page is not None:
        write_document(findings_page(rs.runs, when, overall, command,
                                     (out / "report.md").as_posix(), cross_tables, cross_text),
                       page)

    doc.h(1, "Ranking and final metrics")
    cols, rows = _ranking_rows(summary, ranks)
    doc.table(cols, rows, caption=(
        "Per workload × precision × strategy, over seeds: mean [95% BCa bootstrap CI]. "
        f"Rank on {LOSS}; `=` marks a tie (intervals overlap); a strategy with any "
        "diverged run ranks below those without. Runs: completed/diverged/failed/incomplete — "
        "statistics use completed runs only. Lower is better in every column."))

    doc.h(1, f"Each strategy against {BASELINE}")
    native = comps[comps["baseline"] == BASELINE]
    if native.empty:
        doc.p(f"No workload×precision cell has both `{BASELINE}` and another strategy.")
    else:
        cols, rows = _comparison_rows(native)
        doc.table(cols, rows, caption=PAIRED_CAPTION.format(b=f"`{BASELINE}`"))
    ref = comps[comps["baseline"] == REFERENCE_PRECISION]
    if not ref.empty:
        doc.h(1, "Each strategy against the fp32 run of the same seed")
        cols, rows = _comparison_rows(ref)
        doc.table(cols, rows, caption=f"The loss gap to fp32: Δ = {LOSS} − that of the "
                  "fp32 run of the same workload and seed. " + PAIRED_CAPTION.format(
                      b="the fp32 reference (strategy `none` at fp32, same workload and seed)"))

    if bench_df is not None:
        doc.h(1, f"{STRATEGY_OVERHEAD.label.capitalize()} by model size (scalelab-bench)")
        sizes = sorted(bench_df["size"].unique())
        rows = []
        for name, g in bench_df.groupby("name", sort=True):
            by = g.set_index("size")
            rows.append([code(name)] + [
                "–" if sz not in by.index else
                f"{fmt(by.loc[sz, 'median_ms'])} ms" + (
                    f" ({by.loc[sz, 'ratio_vs_gradscaler']:.2f}×)"
                    if np.isfinite(by.loc[sz, "ratio_vs_gradscaler"]) else "")
                for sz in sizes])
        doc.table(["strategy", *[f"{human(sz)} params" for sz in sizes]], rows, caption=(
            "Median time per step of the strategy alone (scale + unscale_ + step + update, no-op "
            "optimizer) and, in brackets, its ratio to torch.amp.GradScaler at the same size."))

    doc.h(1, "Run status")
    c_cols, c_rows, b_cols, b_rows = _status_rows(rs)
    doc.table(c_cols, c_rows, caption="Every run found, by status. Nothing is dropped.")
    if b_rows:
        doc.table(b_cols, b_rows, caption="Runs that did not complete normally, or whose "
                  "records had values of the wrong type or unreadable lines (ignored).")
    else:
        doc.p("Every run completed.")
    if rs.problems:
        doc.p(f"**Bad records** ({len(rs.problems)}): each file or directory that could not be "
              "read, or only in part, or held values of the wrong type, with the reason; what "
              "it lacked was skipped while loading (limits: docs/report.md).")
        doc.bullets([code(p, max_chars=300) for p in rs.problems])

    d_cols, d_rows = _diagnosis_rows(rs.runs)
    if d_rows:
        doc.h(1, "Diagnoses")
        doc.table(d_cols, d_rows, caption=(
            "What the doctor (scalelab-doctor, docs/doctor.md) found on the failing step of each "
            "stalled, diverged or scale-floor run (its diagnosis.json; runs.csv columns "
            "diagnosis, diagnosis_module, diagnosis_verdict, diagnosis_fix, diagnosis_error)."))

    doc.h(1, "Figures")
    notes: list[str] = []
    figs = F.all_figures(rs, summary, bench_df, notes)
    try:
        for f in figs:
            path = F.save(f, fig_dir, notes=notes)
            if path is not None:
                doc.h(2, f.title)
                doc.image(path, f.title, f.caption)
    finally:
        F.close_all(figs)
    if notes:
        doc.p("Not drawn from these records:")
        doc.bullets([code(n, max_chars=300) for n in notes])
    if bench_note:
        doc.p(bench_note + ".")

    doc.h(1, "Method")
    doc.bullets([
        "Unit of comparison: workload (`model/data/regime`) × precision; one value per run "
        "(seed).",
        f"Intervals: 95% bootstrap over seeds (scipy.stats.bootstrap, BCa for means and IQMs, "
        f"percentile for probabilities), {n_boot} resamples, RNG seed {SEED} (reproducible). "
        "No bootstrap fixes few seeds: a nominal 95% interval of a mean covers the truth about "
        "70% of the time with 3 seeds, about 93% with 20.",
        "IQM: mean of the middle 50% of runs (scipy `trim_mean(x, 0.25)`); equals the mean below "
        "4 runs.",
        f"Comparisons with `{BASELINE}` and with the fp32 reference are paired by seed: mean "
        "per-seed difference with a bootstrap CI over seeds, paired t-test (Holm-adjusted over "
        "the strategies of one comparison), exact Wilcoxon signed-rank test, fraction of seeds "
        "where the strategy is lower with a Clopper–Pearson CI. *Clearly* better/worse: Holm "
        "t p < 0.05, Wilcoxon p < 0.05 or, with ≤ 5 seeds (min p = 2/2^n ≥ 0.0625), every seed "
        "agreeing, and the CI of the difference excluding 0; "
        f"*{TOO_FEW}*: only the CI excludes 0. Unpaired Welch, "
        "Mann–Whitney and P(improvement) are in comparisons.csv.",
        f"Ranking: by fraction of diverged runs, then mean {LOSS}; tied while the 95% "
        "intervals overlap the tier leader's.",
        f"Which strategy when: the metrics are read in this order — {order_text()}; the best "
        f"strategy is the one read {CLEARLY_BETTER} than `{BASELINE}` on the earliest metric "
        "where any is (analysis/when.py).",
        "Metrics: " + "; ".join(f"**{m.label}** — {m.description}" for m in METRICS) + ".",
    ])

    write_document(doc, out / "report.md")
    return write_document(doc, out / "report.html")


def _one_line(text: str) -> str:
    """``text`` on one line (control characters as spaces), at most 300 characters."""
    return code(text, max_chars=300)[1:-1]


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
    parser.add_argument("--page", default=None, metavar="PATH", help="also write the short "
                        "findings page (docs/findings.md under make compare) there")
    parser.add_argument("--n-boot", type=int, default=N_BOOT, help=f"bootstrap resamples "
                        f"(default {N_BOOT})")
    args = parser.parse_args(argv)
    if args.n_boot < 1:
        print(f"scalelab-report: error: --n-boot must be >= 1, got {args.n_boot}", file=sys.stderr)
        return 2
    problems: list[str] = []
    try:
        command = " ".join(["scalelab-report", *args.run_dirs, "--out", args.out]
                           + (["--page", args.page] if args.page else []))
        path = build_report(args.run_dirs, args.out, args.bench, n_boot=args.n_boot,
                            problems=problems, page=args.page, command=command)
    except RunLoadError as exc:
        print(f"scalelab-report: error: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"scalelab-report: bad record: {_one_line(line)}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
