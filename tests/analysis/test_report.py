"""scalelab-report end to end on a synthetic sweep: files, self-contained HTML, CSV, statuses."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load_runs
from analysis.report import build_report, main
from analysis.tables import compare_to_baseline, rank_strategies, summarize
from analysis.verdict import overall_verdict
from tests.analysis.synth import SweepSpec, write_sweep


class _Html(HTMLParser):
    """Collects <img> tags, table cells and text of a page (stdlib parser: the page must parse)."""

    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str]] = []
        self.links: list[str] = []
        self.text: list[str] = []
        self.open_tags: list[str] = []

    VOID = {"meta", "img", "br", "link", "hr", "input"}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        if tag in ("link", "script") and (a.get("href") or a.get("src")):
            self.links.append(a.get("href") or a.get("src"))
        if tag not in self.VOID:
            self.open_tags.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.open_tags and self.open_tags[-1] == tag, f"unbalanced </{tag}>"
        self.open_tags.pop()

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory) -> Path:
    root, _ = sweep
    out = tmp_path_factory.mktemp("report")
    bench = out / "bench.json"
    bench.write_text(json.dumps({"meta": {}, "stats_pass": [], "overhead": [
        {"size": s, "tensors": 8, "name": n, "median_ms": ms * s / 1e6,
         "ratio_vs_gradscaler": r} for s in (10**6, 10**7)
        for n, ms, r in (("GradScaler", 1.0, 1.0), ("native", 1.1, 1.1), ("max_ema", 1.5, 1.5))
    ]}))
    path = build_report([root], out / "rep", bench, n_boot=300)
    assert path == out / "rep" / "report.html"
    return out / "rep"


def test_html_is_self_contained_and_embeds_every_figure(report: Path):
    page = _Html()
    page.feed((report / "report.html").read_text(encoding="utf-8"))
    page.close()
    assert page.open_tags == []
    assert page.links == []  # no external stylesheet or script
    pngs = sorted(p.name for p in (report / "figures").glob("*.png"))
    assert sorted(i["data-file"] for i in page.imgs) == pngs
    for img in page.imgs:
        assert img["src"].startswith("data:image/png;base64,")
        assert (report / "figures" / img["data-file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    kinds = {re.sub(r"-.*", "", p.removesuffix(".png")) for p in pngs}
    assert kinds == {"overview", "loss", "intervals", "paired", "scales", "skipped", "underflow",
                     "exponents", "overhead_vs_size"}


def test_markdown_references_the_same_figures(report: Path):
    md = (report / "report.md").read_text(encoding="utf-8")
    refs = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(refs) == sorted(f"figures/{p.name}" for p in (report / "figures").glob("*.png"))
    assert md.index("## Verdict") < md.index("## Ranking") < md.index("## Figures")


def test_results_csv_has_one_row_per_group(report: Path, sweep):
    root, _ = sweep
    res = pd.read_csv(report / "results.csv")
    runs = pd.read_csv(report / "runs.csv")
    groups = runs.groupby(["workload", "precision", "strategy"], dropna=False).ngroups
    assert len(res) == groups
    assert not res.duplicated(["workload", "precision", "strategy"]).any()
    fp16 = res[(res["precision"] == "fp16") & res["workload"].notna()].set_index("strategy")
    assert fp16["rank"].to_dict() == {"max_ema": 1, "layerwise": 2, "native": 3, "none": 4}
    assert {"final_primary_mean_lo", "final_primary_iqm_hi", "skipped_steps_mean",
            "strategy_overhead_frac_mean", "act_zero_frac_mean_mean"} <= set(res.columns)


def test_failed_diverged_and_incomplete_runs_are_listed(report: Path, sweep):
    root, info = sweep
    page = _Html()
    page.feed((report / "report.html").read_text(encoding="utf-8"))
    text = " ".join(page.text)
    for kind in ("failed", "diverged", "incomplete"):
        run_id = f"synthetic/{info['extras'][kind]}"
        assert re.search(re.escape(run_id) + r"\s+" + kind, text), kind
    assert "synthetic failure for the test" in text
    assert "corrupt line skipped" in text
    runs = pd.read_csv(report / "runs.csv")
    assert len(runs) == info["n_runs"]


def test_verdict_names_the_true_winner_and_the_bench_table(report: Path):
    md = (report / "report.md").read_text(encoding="utf-8")
    verdict = md.split("## Verdict", 1)[1].split("## ", 1)[0]
    assert "`max_ema` kept training healthiest" in verdict
    assert "`max_ema` vs `native`: clearly better than native" in verdict
    assert "With only 3 seeds" in verdict
    assert "| `max_ema` | 1.5 ms (1.50×) | 15 ms (1.50×) |" in md


def test_cli_missing_or_empty_directory_exits_2(tmp_path: Path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scalelab-report: error:") and "does not exist" in err
    assert len(err.splitlines()) == 1
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no run records" in capsys.readouterr().err


def test_cli_prints_the_report_path(tmp_path: Path, capsys):
    write_sweep(tmp_path / "s", SweepSpec(true_loss={"native": 0.7, "max_ema": 0.6}, seeds=2,
                                          extras=False, fp32_reference=False, steps=10))
    assert main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--n-boot", "100",
                 "--bench", str(tmp_path / "missing.json")]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "o" / "report.html")
    md = (tmp_path / "o" / "report.md").read_text(encoding="utf-8")
    assert "benchmark JSON not found" in md


def test_report_without_baseline_or_finished_runs_still_renders(tmp_path: Path):
    """`native` present only as an unfinished run, and a strategy with no records at all: the
    report says "not comparable" instead of crashing or inventing a comparison."""
    write_sweep(tmp_path / "s", SweepSpec(true_loss={"max_ema": 0.6}, seeds=2, extras=True,
                                          fp32_reference=False, steps=20))
    build_report([tmp_path / "s"], tmp_path / "o", n_boot=100)
    md = (tmp_path / "o" / "report.md").read_text(encoding="utf-8")
    assert "not comparable (too few finished runs)" in md
    assert "detectably lower primary metric than `native`" not in md
    # no native at all: an empty comparison table (with its columns) and no claim about native
    runs = load_runs(tmp_path / "s").runs
    runs = runs[runs["strategy"] != "native"]
    comps = compare_to_baseline(runs, n_boot=100)
    assert comps.empty and "poi_lo" in comps.columns
    summary = summarize(runs, n_boot=100)
    verdict = overall_verdict(summary, rank_strategies(summary), comps)
    assert "`max_ema` kept training healthiest" in verdict and "native" not in verdict
    res = pd.read_csv(tmp_path / "o" / "results.csv")
    layerwise = res[res["strategy"] == "layerwise"]  # only an incomplete run, no records
    assert layerwise["rank"].isna().all() and (layerwise["n_incomplete"] == 1).all()
