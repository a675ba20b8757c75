"""Reading scalelab-bench JSON: real layout accepted, anything else skipped with a reason."""

from __future__ import annotations

import json
from pathlib import Path

from analysis.bench import load_bench


def test_overhead_rows_are_read(tmp_path: Path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"torch": "x"}, "stats_pass": [{"size": 10}], "overhead": [
        {"size": 1000, "tensors": 2, "name": "GradScaler", "median_ms": 0.3,
         "ratio_vs_gradscaler": 1.0, "samples_ms": [0.3]},
        {"size": 1000, "tensors": 2, "name": "native", "median_ms": 0.6,
         "ratio_vs_gradscaler": 2.0, "samples_ms": [0.6]},
        {"size": 1000, "tensors": 2, "name": "none", "median_ms": 0.1,
         "ratio_vs_gradscaler": None, "samples_ms": [0.1]},
        {"size": "1K", "name": "bad row"},
    ]}))
    df, note = load_bench(path)
    assert note is None
    assert df["name"].tolist() == ["GradScaler", "native", "none"]
    assert df.set_index("name").loc["native", "ratio_vs_gradscaler"] == 2.0
    assert df["ratio_vs_gradscaler"].isna().tolist() == [False, False, True]


def test_absent_or_malformed_bench_gives_a_note_not_an_error(tmp_path: Path):
    assert load_bench(None)[0] is None and "--bench" in load_bench(None)[1]
    df, note = load_bench(tmp_path / "missing.json")
    assert df is None and "not found" in note
    (tmp_path / "bad.json").write_text("{oops")
    df, note = load_bench(tmp_path / "bad.json")
    assert df is None and "unreadable" in note
    (tmp_path / "other.json").write_text(json.dumps({"results": [{"a": 1}]}))
    df, note = load_bench(tmp_path / "other.json")
    assert df is None and "no `overhead` rows" in note
