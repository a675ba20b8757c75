"""analysis/block_section.py: the report's block-scaling section on real app runs (MXFP8 and NVFP4,
trained here), its numbers re-computed from the runs' own metrics.jsonl, worst rows first, and
nothing for runs without block casts."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

from analysis.block_section import block_reading, block_table
from analysis.load import load_runs
from analysis.report import build_report
from analysis.runset import exp_range
from tests.experiments.runs import read_rows, run_tiny

COMMON = ("strategy=native", "train.steps=4", "train.log_every=2")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("blocks")
    run_tiny(root / "mxfp8" / "seed0", "precision=mxfp8", "seed=0", *COMMON, model="gpt")
    run_tiny(root / "mxfp8" / "seed1", "precision=mxfp8", "seed=1", *COMMON, model="gpt")
    run_tiny(root / "nvfp4" / "seed0", "precision=nvfp4", "seed=0", *COMMON, model="gpt")
    run_tiny(root / "bf16" / "seed0", "precision=bf16", "seed=0", *COMMON, model="gpt")
    return root


def _restated(run_dirs: list[Path]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (role, layer), straight from the train lines' ``block_stats``: blocks-weighted shares and
    the lowest / highest exponent any nonzero histogram bin holds."""
    acc: dict = defaultdict(lambda: {"n": 0.0, "clip": 0.0, "flush": 0.0, "lo": None, "hi": None})
    for d in run_dirs:
        for line in read_rows(d):
            for layer, roles in (line.get("block_stats") or {}).items():
                for role, row in roles.items():
                    a = acc[(role, layer)]
                    a["n"] += row["blocks"]
                    a["clip"] += row["clipped_share"] * row["blocks"]
                    a["flush"] += row["flushed_share"] * row["blocks"]
                    h = row["scale_exp_hist"]
                    exps = [h["lo"] + i for i, c in enumerate(h["counts"]) if c > 0]
                    a["lo"] = min(exps + ([a["lo"]] if a["lo"] is not None else []))
                    a["hi"] = max(exps + ([a["hi"]] if a["hi"] is not None else []))
    return {k: {"blocks": a["n"], "clipped_share": a["clip"] / a["n"], "flushed_share": a["flush"] / a["n"],
                "scale_exp_lo": a["lo"], "scale_exp_hi": a["hi"]} for k, a in acc.items()}


def test_the_table_matches_the_records_and_puts_the_worst_rows_first(sweep):
    table = block_table(load_runs(str(sweep)).blocks)
    assert set(table["precision"]) == {"mxfp8", "nvfp4"}  # the bf16 run casts no block
    for prec, dirs in (("mxfp8", [sweep / "mxfp8" / "seed0", sweep / "mxfp8" / "seed1"]),
                       ("nvfp4", [sweep / "nvfp4" / "seed0"])):
        t = table[table["precision"] == prec].set_index(["role", "layer"])
        want = _restated(dirs)
        assert set(t.index) == set(want) and {r for r, _ in want} == {"activation", "weight", "gradient"}
        for key, w in want.items():
            for col, v in w.items():
                assert t.loc[key, col] == pytest.approx(v, rel=1e-9), (prec, key, col)
        assert set(t["runs"]) == {len(dirs)}
        clipped = table[table["precision"] == prec]["clipped_share"].tolist()
        assert clipped == sorted(clipped, reverse=True)
    assert (table["clipped_share"] > 0).any() and (table["scale_exp_hi"] >= table["scale_exp_lo"]).all()


def test_the_reading_names_the_worst_row_and_the_exponent_span(sweep):
    table = block_table(load_runs(str(sweep)).blocks)
    worst = table[table["precision"] == "mxfp8"].iloc[0]
    line = block_reading(table, "mxfp8")
    assert f"`{worst['layer']}` {worst['role']}" in line and f"{100 * worst['clipped_share']:.1f}%" in line
    lo, hi = table.loc[table["precision"] == "mxfp8", ["scale_exp_lo", "scale_exp_hi"]].agg(["min", "max"]).to_numpy()
    assert f"2^{int(lo[0])} to 2^{int(hi[1])}" in line
    calm = table.assign(clipped_share=0.0)
    assert "no block clips its max element" in block_reading(calm, "mxfp8")
    assert "no block statistics" in block_reading(table, "fp8_blockwise")


def test_the_report_holds_the_section_only_where_runs_cast_blocks(sweep, tmp_path):
    build_report([str(sweep)], tmp_path / "all", n_boot=200)
    text = (tmp_path / "all" / "report.md").read_text()
    assert "# Block scaling" in text and "`mxfp8`: " in text and "`nvfp4`: " in text
    build_report([str(sweep / "bf16")], tmp_path / "plain", n_boot=200)
    assert "Block scaling" not in (tmp_path / "plain" / "report.md").read_text()


def test_a_hostile_histogram_gives_no_range_and_the_rest_still_reads(sweep, tmp_path):
    assert exp_range({"lo": -3, "counts": [0, 2, 0, 5, 0]}) == (-2, 0)
    for bad in (None, [], {"lo": "x", "counts": [1]}, {"lo": 1, "counts": "1"}, {"lo": 1, "counts": [0, 0]}):
        assert exp_range(bad) == (None, None)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("summary.json", "metrics.jsonl"):
        (run / name).write_bytes((sweep / "nvfp4" / "seed0" / name).read_bytes())
    lines = read_rows(run)
    for line in lines:
        for roles in (line.get("block_stats") or {}).values():
            for row in roles.values():
                row["scale_exp_hist"] = {"lo": "hostile", "counts": [1]}
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = block_table(load_runs(str(run)).blocks)
    assert len(table) > 0 and table["scale_exp_lo"].isna().all() and table["clipped_share"].notna().all()
    assert "2^– to 2^–" in block_reading(table, "nvfp4")
    assert block_table(pd.DataFrame()).empty
    older = load_runs(str(run)).blocks.drop(columns=["scale_exp_lo", "scale_exp_hi", "flushed_share"])
    assert block_table(older)["flushed_share"].isna().all()  # a table built without them still reads
