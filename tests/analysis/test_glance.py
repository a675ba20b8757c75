"""Issue 30, item 7: the report at a glance — bold around code renders as bold, the paired figure
joins no seed across strategies, no colour repeats among 16 strategies, legends sit off the data,
and one overview picture of strategy × regime with each cell's reading opens the report."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

from analysis.document import Document, write_document
from analysis.figures import figure_rc, loss_curve_figures, paired_difference_figures
from analysis.figures.common import PALETTE, palette
from analysis.figures.overview import KINDS, kind_of, overview_figure
from analysis.load import load_runs
from analysis.report import build_report
from analysis.words import (BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE, NO_DIFFERENCE,
                            NOT_COMPARABLE, TIE)


def test_bold_around_code_spans_is_bold_in_html(tmp_path: Path) -> None:
    doc = Document("t")
    doc.bullets(["**`rl` at `fp16`**: fine", "`a**b**c` stays code"])
    html = write_document(doc, tmp_path / "p.html").read_text()
    assert "<li><b><code>rl</code> at <code>fp16</code></b>: fine</li>" in html
    assert "<code>a**b**c</code> stays code" in html
    assert "**" not in html.replace("<code>a**b**c</code>", "")


def test_sixteen_strategies_get_sixteen_distinct_colours() -> None:
    names = [f"rule{i:02d}" for i in range(16)]
    colours = [to_rgb(c) for c in palette(names).values()]
    assert len(set(colours)) == 16
    dist = min(np.linalg.norm(np.subtract(a, b)) for a, b in itertools.combinations(colours, 2))
    assert dist >= 0.19  # the colorblind palette's own closest pair is 0.196 apart
    assert len(set(PALETTE)) == len(PALETTE) == 20


def test_the_paired_figure_joins_no_seed_across_strategies(sweep) -> None:
    root, _ = sweep
    with figure_rc():
        figs = paired_difference_figures(load_runs(root).runs)
    assert figs
    for f in figs:
        ax = f.fig.axes[0]
        assert len(ax.get_lines()) == 1  # the dashed zero line only: no seed line
        assert ax.get_lines()[0].get_linestyle() == "--"


def test_legends_sit_right_of_the_data(sweep) -> None:
    root, _ = sweep
    with figure_rc():
        figs = loss_curve_figures(load_runs(root))
        assert figs
        for f in figs:
            renderer = FigureCanvasAgg(f.fig).get_renderer()
            for ax in f.fig.axes:
                if ax.get_legend() is not None:
                    legend = ax.get_legend().get_window_extent(renderer)
                    assert legend.x0 >= ax.get_window_extent(renderer).x1


def test_every_reading_maps_to_better_tie_or_worse() -> None:
    words = [k for k, _ in KINDS]
    assert words[kind_of(CLEARLY_BETTER)] == CLEARLY_BETTER
    assert words[kind_of(CLEARLY_WORSE)] == CLEARLY_WORSE
    assert {words[kind_of(r)] for r in (BETTER_FEW, NO_DIFFERENCE)} == {TIE}
    assert words[kind_of(NOT_COMPARABLE)] == NOT_COMPARABLE


def test_the_overview_cells_say_the_table_s_readings() -> None:
    comps = pd.DataFrame([
        dict(workload="m/d/a", precision="fp16", strategy="x", baseline="native",
             metric="final_primary", reading=CLEARLY_BETTER, paired_diff=-0.25),
        dict(workload="m/d/b", precision="fp16", strategy="x", baseline="native",
             metric="final_primary", reading=NO_DIFFERENCE, paired_diff=0.01),
        dict(workload="m/d/a", precision="fp16", strategy="y", baseline="native",
             metric="final_primary", reading=CLEARLY_WORSE, paired_diff=0.5)])
    with figure_rc():
        f = overview_figure(comps)
    ax = f.fig.axes[0]
    kinds = ax.images[0].get_array()
    # rows native, x, y; columns a, b
    assert kinds.tolist() == [[1, 1], [2, 3], [4, 0]]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
             for t in ax.texts}
    assert texts[(1, 0)] == "-0.25" and texts[(2, 0)] == "0.5" and texts[(0, 1)] == "baseline"
    assert texts[(2, 1)] == ""  # y did not run on b


def test_the_report_opens_with_the_overview(sweep, tmp_path: Path) -> None:
    root, _ = sweep
    build_report([root], tmp_path / "rep", n_boot=200)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert md.index("![overview](figures/overview.png)") < md.index("## Verdict")
    assert (tmp_path / "rep" / "figures" / "overview.png").stat().st_size > 0


def test_a_tiny_fraction_never_shows_as_zero() -> None:
    comps = pd.DataFrame([dict(workload="m/d/a", precision="fp16", strategy="x",
                               baseline="native", metric="fidelity_lost_frac_mean",
                               reading=CLEARLY_WORSE, paired_diff=3.73e-6)])
    with figure_rc():
        f = overview_figure(comps)
    assert "0.000373%" in {t.get_text() for t in f.fig.axes[0].texts}
