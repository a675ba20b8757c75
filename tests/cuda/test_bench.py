"""scalelab-bench runs end to end on tiny sizes and writes every row it promises (no timing
assertions: benchmarks report numbers, tests check structure)."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

import strategies
from experiments.bench import cli as bench, common as bench_common, steps as bench_steps


def test_bench_writes_rows_for_every_strategy(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["--sizes", "3000,20K", "--repeats", "3", "--steps", "1", "--tensors", "4",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    names = {r["name"] for r in data["overhead"]}
    assert names == {"none", "GradScaler", *strategies.available(), *bench_common.VARIANTS}
    assert {r["size"] for r in data["overhead"]} == {3000, 20_000}
    gs = [r for r in data["overhead"] if r["name"] == "GradScaler"]
    assert all(r["ratio_vs_gradscaler"] == pytest.approx(1.0) for r in gs)
    assert all(r["median_ms"] > 0 for r in data["overhead"])
    assert [r["size"] for r in data["stats_pass"]] == [3000, 20_000]
    for r in data["stats_pass"]:  # ratios: the median over rounds of the same round's ratio
        t = r["samples_ms"]
        assert len(t["fused"]) == len(t["foreach_mul"]) == len(t["torch_unscale"]) == 3
        for other in ("foreach_mul", "torch_unscale"):
            want = statistics.median(a / b for a, b in zip(t["fused"], t[other]))
            assert r[f"fused_over_{other}"] == pytest.approx(want)
    table = capsys.readouterr().out
    assert "GradScaler" in table and "fused/mul" in table and "fused/unscale" in table
    assert [(r["model"], r["strategy"]) for r in data["hooks"]] == [
        (m, k) for m in bench_steps.HOOK_MODELS for k in bench_common.HOOKED]  # the MLP and the GPT
    assert all(r["ratio"] > 0 and r["plain_ms"] > 0 and r["attached_ms"] > 0 for r in data["hooks"])
    assert [(r["strategy"], r["stats_every"], r["stats_layers"]) for r in data["stats_every"]] == [
        (name, k, q) for name in bench_common.HOOKED for k, q in bench_steps.EVERY
        if q == 1.0 or not name.startswith("layerwise")]  # layerwise reads every group
    assert "(e) statistics every k steps" in table


@pytest.mark.parametrize("text,value", [("50M", 50_000_000), ("250K", 250_000), ("1000", 1000), ("1.5M", 1_500_000)])
def test_parse_size(text, value):
    assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "0", "-3M"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="sizes must"):
        bench.parse_size(text)


def test_rejects_unknown_strategy(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "1000", "--strategies", "nope", "--out", str(tmp_path / "x.json")])
