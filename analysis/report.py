"""``scalelab-report RUN_DIR... [--out DIR] [--bench bench.json]`` — the comparison report.

Loads every run under the given sweep directories (:mod:`analysis.load`), computes interval
estimates, comparisons with ``native`` and tiered rankings (:mod:`analysis.stats`), draws the
figures (:mod:`analysis.figures`) and writes into ``--out`` (default ``reports/compare``):

* ``report.md`` and a self-contained ``report.html`` (figures embedded as base64 PNG) — a plain
  verdict first, then tables with intervals, the block casts of runs in a block-scaled precision
  mode (:mod:`analysis.block_section`), run statuses, figures and method notes;
* ``results.csv`` — one row per workload × precision × strategy (counts by status, every
  metric's mean/IQM with 95 % intervals, rank); ``comparisons.csv`` (each strategy vs native,
  per metric, and vs the fp32 run of the same seed on the primary metric), ``runs.csv`` (one row
  per run, failed/diverged/incomplete included, with ``steps_to_target``) and
  ``which_strategy_when.csv`` (per regime × precision: the best strategy, its paired effects
  and why; :mod:`analysis.when`), also the first table of the verdict, and
  ``cross_workload.csv`` (per strategy across workloads: AlgoPerf's score B, rliable's IQM and
  P(improvement vs native), with intervals; :mod:`analysis.profiles`), the second; ``replay.csv``
  (per failed or stalled run and preset: what the preset would have done on the run's trace, from
  the ``replay.json`` files ``scalelab-replay SWEEP_DIR --table`` wrote; :mod:`analysis.replays`);
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

import pandas as pd

from analysis.block_section import block_section
from analysis.bench import load_bench
from analysis.document import Document, write_document
from analysis.findings import findings_page
from analysis.load import RunLoadError, load_runs
from analysis.records import STATUSES
from analysis.replays import read_replays, replay_section
from analysis.runset import RunSet
from analysis.sections import (Comparison, bench_section, comparison_sections,
                               diagnosis_section, figures_section, fresh_figures, method_section,
                               overview_section, ranking_section, status_section,
                               verdict_section, verdicts)
from analysis.stats import N_BOOT
from analysis.tables import compare_to_baseline, compare_to_reference, rank_strategies, summarize
from analysis.text import code, write_csv
from analysis.when import cross_workload_table, which_strategy_when

__all__ = ["build_report", "compare", "main", "results_table", "write_tables"]


def compare(rs: RunSet, *, n_boot: int = N_BOOT, bench: str | Path | None = None) -> Comparison:
    """Every table of the report from the runs ``rs``: summary, comparisons against ``native``
    and fp32, ranking, which strategy when, across workloads, and the ``bench`` JSON's rows."""
    summary = summarize(rs.runs, n_boot=n_boot)
    comps = pd.concat([compare_to_baseline(rs.runs, n_boot=n_boot),
                       compare_to_reference(rs.runs, n_boot=n_boot)], ignore_index=True)
    ranks = rank_strategies(summary)
    cross, cross_notes = cross_workload_table(rs.runs, rs.train, n_boot=n_boot)
    bench_df, bench_note = load_bench(bench)
    return Comparison(rs, summary, comps, ranks, which_strategy_when(rs.runs, comps), cross,
                      cross_notes, bench_df, bench_note)


def results_table(summary: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """``results.csv``: the summary with rank and tie columns, one row per group."""
    return summary.merge(ranks[["workload", "precision", "strategy", "rank", "tied_with",
                                "diverged_frac"]],
                         on=["workload", "precision", "strategy"], how="left")


def write_tables(c: Comparison, out: Path) -> None:
    """The CSV files of the report (module docstring) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results_table(c.summary, c.ranks), out / "results.csv")
    write_csv(c.comps, out / "comparisons.csv")
    write_csv(c.when, out / "which_strategy_when.csv")
    write_csv(c.cross, out / "cross_workload.csv")
    write_csv(c.rs.runs, out / "runs.csv")


def _provenance(rs: RunSet) -> str:
    """The report's first line: how many runs from where, by status, and when it was made."""
    n_status = rs.runs["status"].value_counts()
    return (f"{len(rs.runs)} runs from {', '.join(code(s) for s in rs.sources)} — "
            + ", ".join(f"{int(n_status.get(s, 0))} {s}"
                        for s in [*STATUSES, *sorted(set(n_status.index) - set(STATUSES))])
            + f". Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}.")


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
    replays = read_replays(rs.runs, rs.problems)
    if problems is not None:
        problems.extend(rs.problems)
    out = Path(out)
    c = compare(rs, n_boot=n_boot, bench=bench)
    write_tables(c, out)
    v = verdicts(c)
    doc = Document("scalelab comparison report")
    doc.p(_provenance(rs))
    fresh_figures(out / "figures")
    overview_section(doc, c, out / "figures")
    verdict_section(doc, c, v)
    if page is not None:
        write_document(findings_page(rs.runs, c.when, v.overall, command,
                                     (out / "report.md").as_posix(), v.cross_tables,
                                     v.cross_text), page)
    ranking_section(doc, c)
    comparison_sections(doc, c)
    bench_section(doc, c.bench)
    block_section(doc, rs)
    status_section(doc, rs)
    diagnosis_section(doc, rs.runs)
    replay_section(doc, replays)
    write_csv(replays, out / "replay.csv")
    figures_section(doc, c, out / "figures")  # after fresh_figures: the overview stays
    method_section(doc, n_boot)
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
