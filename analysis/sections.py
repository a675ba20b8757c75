"""The sections of the comparison report (:func:`analysis.report.build_report`), in report order:
each ``*_section`` function appends its headings, tables and text to the report's
:class:`~analysis.document.Document`, from the tables of one :class:`Comparison`.

Verdict (which strategy when, across workloads, the overall and per-cell verdicts), ranking and
final metrics, each strategy against ``native`` and against the fp32 run of the same seed,
strategy overhead by model size (with ``--bench``), run status, diagnoses, figures, method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import figures as F
from analysis.document import Document
from analysis.figures.overview import overview_figure
from analysis.metrics import (ACT_ZERO_FRAC, FINAL_PRIMARY, METRICS, PRIMARY, SKIPPED_STEPS,
                              STEPS_TO_TARGET, STRATEGY_OVERHEAD, metric)
from analysis.records import STATUSES
from analysis.runset import RunSet
from analysis.stats import SEED
from analysis.tables import BASELINE
from analysis.targets import REFERENCE_PRECISION
from analysis.text import code, fmt, fmt_ci, fmt_p, human, pct
from analysis.verdict import cell_verdict, overall_verdict, phrase, primary_words
from analysis.when import CROSS_CAPTION, cross_rows, cross_verdict, order_text, table_rows
from analysis.words import CLEARLY_BETTER, CLEARLY_WORSE, TIE, TOO_FEW

__all__ = ["Comparison", "PAIRED_CAPTION", "Verdicts", "bench_section", "comparison_sections",
           "diagnosis_section", "figures_section", "fresh_figures", "method_section",
           "overview_section", "ranking_section", "status_section", "verdict_section",
           "verdicts"]

LOSS = FINAL_PRIMARY.label


@dataclass
class Comparison:
    """The tables one report is made of: the runs (``rs``), per-strategy ``summary``, paired
    comparisons ``comps`` (against ``native`` and against fp32), ``ranks``, which strategy
    ``when``, the ``cross``-workload table with its ``cross_notes``, and the ``bench`` table
    (``None`` without ``--bench``) with its ``bench_note``."""

    rs: RunSet
    summary: pd.DataFrame
    comps: pd.DataFrame
    ranks: pd.DataFrame
    when: pd.DataFrame
    cross: pd.DataFrame
    cross_notes: list[str]
    bench: pd.DataFrame | None
    bench_note: str | None


@dataclass
class Verdicts:
    """The verdict in words: ``overall`` (one paragraph), one line per reduced-precision
    workload × precision (``cells``), the cross-workload table(s) as (columns, rows, caption)
    and their one-sentence verdict ``cross_text``."""

    overall: str
    cells: list[str]
    cross_tables: list[tuple[list[str], list[list[str]], str]] = field(default_factory=list)
    cross_text: str = ""


def verdicts(c: Comparison) -> Verdicts:
    """The verdicts of ``c`` (:mod:`analysis.verdict`, :func:`analysis.when.cross_verdict`)."""
    tables = []
    if not c.cross.empty:
        cols, rows = cross_rows(c.cross)
        tables.append((cols, rows, CROSS_CAPTION + "".join(f" {code(n, max_chars=300)}."
                                                           for n in c.cross_notes)))
    cells = (c.ranks[c.ranks["precision"] != REFERENCE_PRECISION][["workload", "precision"]]
             .dropna().drop_duplicates().sort_values(["workload", "precision"]))
    return Verdicts(overall_verdict(c.summary, c.ranks, c.comps),
                    [cell_verdict(w, p, c.ranks, c.summary, c.comps) for w, p in cells.to_numpy()],
                    tables, cross_verdict(c.cross))


def verdict_section(doc: Document, c: Comparison, v: Verdicts) -> None:
    """Which strategy when, across workloads, the overall verdict and one line per cell."""
    doc.h(1, "Verdict")
    if not c.when.empty:
        cols, rows = table_rows(c.when)
        doc.table(cols, rows, caption=(
            "Which strategy when (which_strategy_when.csv). The verdict reads the metrics in "
            f"this order: {order_text()}. Best = the strategy read *{CLEARLY_BETTER}* than "
            f"`{BASELINE}` (paired by seed) on the earliest of them for which any strategy is, "
            f"the largest mean paired gain among several (a {TIE} where several show the same); "
            f"{STRATEGY_OVERHEAD.label} is wall-clock time and never decides; one read "
            f"*{CLEARLY_WORSE}* on an "
            f"earlier metric is not counted. No best where none is {CLEARLY_BETTER}: the row "
            "then says what the paired readings say. Δ = strategy − baseline per seed, mean "
            f"[95% CI]; against fp32 it is the gap in the {LOSS} to the fp32 run of the same "
            "seed. Cells without `native` (controls) are compared with fp32 only."))
    for cols, rows, caption in v.cross_tables:
        doc.table(cols, rows, caption=caption)
    doc.p(v.cross_text)
    doc.p(v.overall)
    doc.bullets(v.cells)


def _ranking_rows(summary: pd.DataFrame, ranks: pd.DataFrame
                  ) -> tuple[list[str], list[list[str]]]:
    merged = summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with"]],
                           on=["workload", "precision", "strategy"], how="left")
    merged = merged.sort_values(["workload", "precision", "rank", f"{PRIMARY}_mean", "strategy"],
                                na_position="last")
    shown = (SKIPPED_STEPS, STRATEGY_OVERHEAD, ACT_ZERO_FRAC)
    cols = ["workload", "precision", "rank", "strategy", "runs ok/div/fail/inc", "ranked by",
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
            primary_words(r),
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


def ranking_section(doc: Document, c: Comparison) -> None:
    """One row per workload × precision × strategy: rank, run counts, final metrics."""
    doc.h(1, "Ranking and final metrics")
    cols, rows = _ranking_rows(c.summary, c.ranks)
    doc.table(cols, rows, caption=(
        "Per workload × precision × strategy, over seeds: mean [95% BCa bootstrap CI]. "
        f"Rank on the {LOSS} each workload declares (ranked by: a higher-is-better metric, the "
        "rl reward, enters negated); `=` marks a tie (intervals overlap); a strategy with any "
        "diverged run ranks below those without. Runs: completed/diverged/failed/incomplete — "
        "statistics use completed runs only. Lower is better in every column."))


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


def comparison_sections(doc: Document, c: Comparison) -> None:
    """Each strategy against ``native``, then (when run) against the fp32 run of the same seed."""
    doc.h(1, f"Each strategy against {BASELINE}")
    native = c.comps[c.comps["baseline"] == BASELINE]
    if native.empty:
        doc.p(f"No workload×precision cell has both `{BASELINE}` and another strategy.")
    else:
        cols, rows = _comparison_rows(native)
        doc.table(cols, rows, caption=PAIRED_CAPTION.format(b=f"`{BASELINE}`"))
    ref = c.comps[c.comps["baseline"] == REFERENCE_PRECISION]
    if not ref.empty:
        doc.h(1, "Each strategy against the fp32 run of the same seed")
        cols, rows = _comparison_rows(ref)
        doc.table(cols, rows, caption=f"The loss gap to fp32: Δ = {LOSS} − that of the "
                  "fp32 run of the same workload and seed. " + PAIRED_CAPTION.format(
                      b="the fp32 reference (strategy `none` at fp32, same workload and seed)"))


def bench_section(doc: Document, bench: pd.DataFrame | None) -> None:
    """Median time per step of each strategy alone by model size (``--bench``; else nothing)."""
    if bench is None:
        return
    doc.h(1, f"{STRATEGY_OVERHEAD.label.capitalize()} by model size (scalelab-bench)")
    sizes = sorted(bench["size"].unique())
    rows = []
    for name, g in bench.groupby("name", sort=True):
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


def status_section(doc: Document, rs: RunSet) -> None:
    """Every run by status, the runs that did not complete normally, and the bad records."""
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


def diagnosis_section(doc: Document, runs: pd.DataFrame) -> None:
    """One row per run the doctor looked at (``diagnosis.json``, or the summary's cause): run,
    status, cause, first module, verdict, fix — or why the doctor could not run; nothing when
    it looked at none."""
    rows = []
    for _, r in runs[runs["diagnosis"].notna() | runs["diagnosis_error"].notna()].iterrows():
        cause = r["diagnosis"] if isinstance(r["diagnosis"], str) else None
        verdict = r["diagnosis_verdict"] if cause else f"doctor did not run: {r['diagnosis_error']}"
        rows.append([code(r["run_id"]), f"**{r['status']}**", code(cause) if cause else "–",
                     code(r["diagnosis_module"]) if isinstance(r["diagnosis_module"], str) else "–",
                     code(verdict, max_chars=300) if isinstance(verdict, str) else "–",
                     code(r["diagnosis_fix"], max_chars=300)
                     if isinstance(r["diagnosis_fix"], str) else "–"])
    if not rows:
        return
    doc.h(1, "Diagnoses")
    doc.table(["run", "status", "cause", "first module", "verdict", "fix"], rows, caption=(
        "What the doctor (scalelab-doctor, docs/doctor.md) found on the failing step of each "
        "stalled, diverged or scale-floor run (its diagnosis.json; runs.csv columns "
        "diagnosis, diagnosis_module, diagnosis_verdict, diagnosis_fix, diagnosis_error)."))


def fresh_figures(fig_dir: Path) -> None:
    """Create ``fig_dir`` and empty it of older PNGs (a regenerated report never shows stale
    figures); the report calls it once, before :func:`overview_section`."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    for old in fig_dir.glob("*.png"):
        old.unlink()


def overview_section(doc: Document, c: Comparison, fig_dir: Path) -> None:
    """The report at a glance, first (:func:`analysis.figures.overview.overview_figure`):
    strategy × regime, each cell's paired reading against ``native`` with its Δ."""
    with F.figure_rc():
        f = overview_figure(c.comps)
    if f is None:
        return
    try:
        path = F.save(f, fig_dir)
    finally:
        F.close_all([f])
    if path is not None:
        doc.image(path, f.title, f.caption)


def figures_section(doc: Document, c: Comparison, fig_dir: Path) -> None:
    """Every figure (:func:`analysis.figures.all_figures`) saved as PNG in ``fig_dir``
    (:func:`fresh_figures` emptied it), and what could not be drawn."""
    doc.h(1, "Figures")
    notes: list[str] = []
    figs = F.all_figures(c.rs, c.summary, c.bench, notes)
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
    if c.bench_note:
        doc.p(c.bench_note + ".")


def method_section(doc: Document, n_boot: int) -> None:
    """How every number of the report is made."""
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
