"""The reproduction page (analysis/reproduce/page.py) from made-up claims over synthetic runs."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from analysis.reproduce import page as rp
from analysis.reproduce.claims.base import Finding
from analysis.text import write_atomic
from analysis.words import EVAL_ERROR, INCONCLUSIVE, NOT_REPRODUCED, NOT_RUN, REPRODUCED
from tests.analysis.fake_claims import FAKE_CLAIMS, SEEDS, write_fake_runs


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reproduce")
    write_fake_runs(root)
    return root


@pytest.fixture(scope="module")
def page(out: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[rp.ClaimResult]]:
    doc = tmp_path_factory.mktemp("doc") / "reproductions.md"
    results = rp.write_page(out, doc, FAKE_CLAIMS, quick=False)
    return doc.read_text(encoding="utf-8"), results


def test_a_page_rebuilt_from_the_same_runs_is_byte_identical(out: Path, page, tmp_path: Path) -> None:
    again = tmp_path / "sub" / "again.md"
    rp.write_page(out, again, FAKE_CLAIMS, quick=False)
    assert again.read_bytes() == page[0].encode("utf-8")


def test_every_finding_is_on_the_page_with_its_interval_and_verdict(page) -> None:
    text, results = page
    good = results[0]
    assert [f.verdict for f in good.findings] == [REPRODUCED, NOT_REPRODUCED]
    for f in good.findings:
        row = f"| good (3 run(s) failed or unfinished) | {f.measure} | {f.paper} | {rp.fmt_estimate(f)} | {f.n} | {f.verdict} |"
        assert row in text
        assert f.n == SEEDS
    # the per-claim table carries the notes, pipes escaped so the table keeps its columns
    assert "synthetic \\| made up" in text
    assert "parity margin ±0.01" in text


def test_a_claim_whose_evaluate_raises_gets_one_row_and_the_page_goes_on(page) -> None:
    text, results = page
    broken = results[1]
    assert broken.findings == [] and broken.verdict == EVAL_ERROR
    line = "evaluate failed: RuntimeError: evaluate blew up on two lines"
    assert broken.problem == line
    assert f"| broken (3 run(s) failed or unfinished) | – | – | {line} | – | error |" in text
    assert "## 3. absent: the absent claim" in text  # the sections after it are written


def test_a_claim_without_runs_says_not_run(page, out: Path) -> None:
    text, results = page
    absent = results[2]
    assert absent.verdict == NOT_RUN and absent.statuses == {}
    assert absent.problem.startswith("no runs (run directory does not exist")
    assert "| absent | – | – | no runs (" in text
    assert f"**Runs:** none under `{out}/absent`." in text


def test_each_claim_section_has_source_claim_deviations_runs_and_larger_command(page, out: Path) -> None:
    text, _ = page
    for k, claim in enumerate(FAKE_CLAIMS, start=1):
        section = text[text.index(f"## {k}. {claim.name}: {claim.title}"):]
        assert f"**Source.** {claim.source}" in section
        assert f"**Claim.** {claim.claim}" in section
        for d in claim.deviations:
            assert f"- {d}" in section
    # synthetic sweep: SEEDS seeds x (4 fp16 strategies + fp32) completed, and one of each extra kind
    n_done = SEEDS * 5
    assert f"**Runs:** {n_done + 4} under `{out}/good` ({n_done} completed, 1 diverged, 1 failed, 2 incomplete)" in text
    assert ("- `scalelab-train -m +experiment=repro_good precision=fp16 strategy=max_ema,native "
            "device=cuda train.steps=...`") in text
    assert "| good (3 run(s) failed or unfinished) |" in text


def test_provenance_is_the_recorded_command_and_the_runs_git_sha_with_no_date(page) -> None:
    text, _ = page
    assert "Made by `scalelab-reproduce`" in text  # no record: the canonical command of the mode
    assert "the **full** setting" in text
    assert "The runs were trained at git `000000000000`." in text
    assert "2026" not in text and "UTC" not in text


def test_failed_sweeps_from_the_record_are_on_the_page(out: Path, tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    write_fake_runs(rec)
    rp.record_start(rec, "scalelab-reproduce --quick", True, ["good"])
    rp.record_sweep(rec, "good", "scalelab-train -m +experiment=repro_good a=1", 0, True)
    rp.record_sweep(rec, "good", "scalelab-train -m +experiment=repro_good a=2", 1, True)
    rp.write_page(rec, tmp_path / "p.md", FAKE_CLAIMS, quick=False)
    text = (tmp_path / "p.md").read_text()
    assert "Made by `scalelab-reproduce --quick`" in text and "the **quick** subset" in text
    assert "- `scalelab-train -m +experiment=repro_good a=1`: exit 0\n" in text
    assert "- `scalelab-train -m +experiment=repro_good a=2`: exit 1 (a job failed or the sweep stopped)" in text
    assert "| good (1 sweep(s) failed; 3 run(s) failed or unfinished) |" in text
    # a later run of another claim keeps good's sweeps, a later run of good forgets them
    rp.record_start(rec, "scalelab-reproduce --claims broken", False, ["broken"])
    assert len(rp.read_record(rec)["claims"]["good"]["sweeps"]) == 2
    rp.record_start(rec, "scalelab-reproduce", False, ["good", "broken"])
    assert {k: v["sweeps"] for k, v in rp.read_record(rec)["claims"].items()} == {"good": [], "broken": []}


def test_a_page_made_by_two_commands_names_each_with_its_claims(out: Path, tmp_path: Path) -> None:
    """The runs of one claim made by a later command (``--claims``) and of the others by an
    earlier one: the page names both commands, each with its claims, not only the last."""
    rec = tmp_path / "rec"
    write_fake_runs(rec)
    rp.record_start(rec, "scalelab-reproduce", False, ["good", "broken"])
    rp.record_start(rec, "scalelab-reproduce --claims broken", False, ["broken"])
    rp.write_page(rec, tmp_path / "p.md", FAKE_CLAIMS, quick=False)
    text = (tmp_path / "p.md").read_text()
    assert "Made by `scalelab-reproduce` (good) and `scalelab-reproduce --claims broken` (broken) from" in text
    # a record written before runners were kept names its last command for every claim
    record = rp.read_record(rec)
    for entry in record["claims"].values():
        del entry["runner"]
    assert rp.made_by(record, ["good", "broken"], "x") == "`scalelab-reproduce --claims broken`"


def test_no_registered_claims_still_writes_a_page(tmp_path: Path) -> None:
    rp.write_page(tmp_path, tmp_path / "p.md", [], quick=False)
    assert "No claims are registered" in (tmp_path / "p.md").read_text()


@pytest.mark.parametrize("est, lo, hi, shown", [
    (0.123456, 0.1, 0.15, "0.123 [0.1, 0.15]"),
    (1.000150, 1.000120, 1.000180, "1.00015 [1.00012, 1.00018]"),   # 3 digits would print 1 [1, 1]
    (-0.5, -0.75, -0.25, "-0.5 [-0.75, -0.25]"),
    (2.5e-6, 1e-6, 4e-6, "2.50e-06 [1.00e-06, 4.00e-06]"),
    (0.3, math.nan, math.nan, "0.3 [no interval]"),
    (math.nan, math.nan, math.nan, "–"),
])
def test_estimates_are_shown_with_enough_significant_digits(est, lo, hi, shown) -> None:
    assert rp.fmt_estimate(Finding("m", "p", est, lo, hi, 10, INCONCLUSIVE)) == shown


def test_the_page_is_written_atomically(tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "p.md"
    doc.write_text("old page\n")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(doc, "new page\n")  # the writer of every page (analysis.document.write_document)
    assert doc.read_text() == "old page\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.md"]  # no temporary file left


def test_a_written_page_has_the_mode_open_gives_and_a_rewrite_keeps_its_mode(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.md", "page\n")
        assert stat.S_IMODE((tmp_path / "new.md").stat().st_mode) == 0o644  # not mkstemp's 0o600
        (tmp_path / "new.md").chmod(0o640)
        write_atomic(tmp_path / "new.md", "page again\n")
        assert stat.S_IMODE((tmp_path / "new.md").stat().st_mode) == 0o640
    finally:
        os.umask(umask)

