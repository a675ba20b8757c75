"""``scalelab-bench --device cuda`` (experiments/bench/gpu.py): its options, bandwidth arithmetic
and generated page on any machine; one end-to-end smoke run on a GPU (marked ``gpu``). No timing
assertions: the tests check structure and arithmetic, never how fast anything ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.bench import cli as bench, common, gpu as bench_gpu, steps as bench_steps
from experiments.bench.common import HOOKED
from tests.helpers import forbid_host_sync


def options(*argv: str) -> bench_gpu.GpuOptions:
    return bench_gpu.gpu_options(bench.build_parser().parse_args(["--device", "cuda", *argv]))


def test_gpu_defaults():
    o = options()
    assert o.stats_sizes == [10_000_000, 30_000_000, 100_000_000]
    assert o.step_sizes == [10_000_000, 100_000_000]
    assert o.dtypes == ["fp16", "bf16", "fp32"]
    assert (o.repeats, o.warmup, o.docs) == (50, 5, Path("docs/bench.md"))
    q = options("--quick")
    assert (q.stats_sizes, q.step_sizes, q.repeats, q.warmup) == ([1_000_000], [1_000_000], 5, 2)


def test_gpu_options_given():
    o = options("--sizes", "2M,250K", "--step-sizes", "3M", "--dtypes", "bf16", "--repeats", "9", "--warmup", "0",
                "--write-docs", "out/page.md")
    assert (o.stats_sizes, o.step_sizes, o.dtypes) == ([2_000_000, 250_000], [3_000_000], ["bf16"])
    assert (o.repeats, o.warmup, o.docs) == (9, 0, Path("out/page.md"))
    assert options("--no-docs").docs is None


@pytest.mark.parametrize("argv,message", [
    (["--dtypes", "fp8"], r"--dtypes must be a comma-separated subset of fp16, bf16, fp32, got 'fp8'"),
    (["--dtypes", ","], r"--dtypes must be"),
    (["--step-sizes", "0"], r"--step-sizes: sizes must be >= 1"),
    (["--sizes", "lots"], r"--sizes: sizes must look like 1M"),
    (["--repeats", "0"], r"--repeats must be >= 1, got 0"),
    (["--warmup", "-1"], r"--warmup must be >= 0, got -1"),
])
def test_gpu_options_reject(argv, message):
    with pytest.raises(ValueError, match=message):
        options(*argv)


@pytest.mark.parametrize("flag", [["--dtypes", "fp16"], ["--step-sizes", "1M"], ["--warmup", "1"],
                                  ["--no-docs"]])  # --write-docs is valid on the CPU too (docs/bench-cpu.md)
def test_gpu_flags_refused_on_cpu(tmp_path, capsys, flag):
    with pytest.raises(SystemExit):
        bench.main([*flag, "--out", str(tmp_path / "x.json")])
    assert "only with --device cuda" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_cuda_without_cuda_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--out", str(tmp_path / "x.json")])
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_steps_refused_on_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--steps", "2", "--out", str(tmp_path / "x.json")])
    assert "--steps: only with --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,want", [("fp32", 800.0), ("fp16", 400.0), ("bf16", 400.0)])
def test_gbps_counts_one_read_and_one_write(dtype, want):
    # 10M elements read and written in 0.1 ms
    assert bench_gpu.gbps(10_000_000, dtype, 0.1) == pytest.approx(want)


def stats_row(dtype: str, size: int, ms: dict[str, float | None]) -> dict:
    """A section (i) row as bench_stats_pass writes it, from made-up times."""
    row = {"size": size, "tensors": 50, "dtype": dtype, "fused_is_kernel": True}
    for k in bench_gpu.STATS_CALLS:
        row[f"{k}_ms"] = ms[k]
        row[f"{k}_gbps"] = None if ms[k] is None else bench_gpu.gbps(size, dtype, ms[k])
    row["fused_over_foreach_mul"] = ms["fused"] / ms["foreach_mul"]
    row["fused_over_torch_unscale"] = None if ms["torch_unscale"] is None else ms["fused"] / ms["torch_unscale"]
    row["reference_over_fused"] = ms["reference"] / ms["fused"]
    return row


def made_up_result() -> dict:
    stats_rows = [stats_row("fp32", 10_000_000, {"fused": 0.04, "foreach_mul": 0.032, "torch_unscale": 0.05,
                                                 "reference": 0.4}),
                  stats_row("bf16", 10_000_000, {"fused": 0.025, "foreach_mul": 0.02, "torch_unscale": None,
                                                 "reference": 0.5})]
    steps = [{"size": s, "tensors": 50, "name": n, "device": "cuda", "median_ms": ms * s / 1e7,
              "ratio_vs_gradscaler": r, "samples_ms": [ms]}
             for s in (10_000_000, 100_000_000)
             for n, ms, r in (("none", 0.01, 0.02), ("GradScaler", 0.5, 1.0), ("max_ema", 0.6, 1.2))]
    meta = {"date_utc": "2026-11-24T14:00:00+00:00", "argv": ["--device", "cuda", "--repeats", "7"],
            "gpu": "Made-up GPU", "compute_capability": "9.0", "sm_count": 132, "gpu_memory_gib": 79.2,
            "torch": "2.11.0", "torch_cuda": "13.0", "python": "3.12.3", "machine": "x86_64",
            "repeats": 7, "warmup": 2}
    return {"meta": meta, "stats_pass": stats_rows, "overhead": steps}


def test_page_says_what_ran_where_and_holds_every_row():
    page = bench_gpu.format_markdown(made_up_result())
    assert "Generated 2026-11-24T14:00:00+00:00 by `scalelab-bench --device cuda --repeats 7`" in page
    assert "Made-up GPU (compute capability 9.0, 132 SMs, 79.2 GiB)" in page
    assert "2.11.0 (CUDA 13.0), Python 3.12.3" in page and "median of 7 rounds after 2 warm-up" in page
    # 10M fp32 read + written: 80 MB in 0.04 ms = 2,000 GB/s; fused/mul = 0.04/0.032
    assert "| fp32 | 10M | 2,000 (0.040 ms) | 2,500 (0.032 ms) | 1,600 (0.050 ms) | 200 (0.400 ms) | 1.25x | 0.80x | 10.00x |" in page
    assert "| bf16 | 10M | 1,600 (0.025 ms) | 2,000 (0.020 ms) | n/a | 80 (0.500 ms) | 1.25x | n/a | 20.00x |" in page
    assert "| 10M: ms / vs GradScaler | 100M: ms / vs GradScaler |" in page
    assert "| max_ema | 0.600 / 1.20x | 6.000 / 1.20x |" in page
    for table in ("| dtype |", "| rule |"):
        block = page[page.index(table):].split("\n\n")[0].splitlines()
        assert len({line.count("|") for line in block}) == 1, "ragged Markdown table"


def test_page_flags_a_missing_kernel():
    result = made_up_result()
    result["stats_pass"][0]["fused_is_kernel"] = False
    assert "NOT built: the fused column ran the plain-torch fallback" in bench_gpu.format_markdown(result)


def test_write_page_creates_its_folder(tmp_path):
    path = tmp_path / "docs" / "bench.md"
    bench_gpu.write_page(made_up_result(), path)
    assert path.read_text(encoding="utf-8") == bench_gpu.format_markdown(made_up_result())


def test_step_rows_feed_the_report(tmp_path):
    """The GPU JSON's ``overhead`` rows are the CPU bench's shape: scalelab-report --bench reads them."""
    reader = pytest.importorskip("analysis.bench")  # pandas: absent on a bare GPU box
    path = tmp_path / "b.json"
    path.write_text(json.dumps(made_up_result()))
    table, note = reader.load_bench(path)
    assert note is None and set(table["name"]) == {"none", "GradScaler", "max_ema"}
    assert table.loc[table["name"] == "max_ema", "ratio_vs_gradscaler"].tolist() == [1.2, 1.2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bench_smoke(tmp_path):
    out, page = tmp_path / "b.json", tmp_path / "docs" / "bench.md"
    assert bench.main(["--device", "cuda", "--sizes", "200K", "--step-sizes", "100K,200K", "--repeats", "3",
                       "--warmup", "1", "--tensors", "4", "--strategies", "native,max_ema,layerwise",
                       "--out", str(out), "--write-docs", str(page)]) == 0
    data = json.loads(out.read_text())
    assert [r["dtype"] for r in data["stats_pass"]] == ["fp16", "bf16", "fp32"]
    for r in data["stats_pass"]:
        assert r["fused_is_kernel"] and r["size"] == 200_000
        assert all(r[f"{k}_gbps"] > 0 for k in ("fused", "foreach_mul", "reference"))
        assert (r["torch_unscale_ms"] is None) == (not bench_gpu.torch_unscale_supports(bench_gpu.DTYPES[r["dtype"]]))
        assert all(len(v) == 3 for v in r["samples_ms"].values())
    names = {"none", "GradScaler", "native", "max_ema", "layerwise", "layerwise_adaloss"}
    assert {(r["name"], r["size"]) for r in data["overhead"]} == {(n, s) for n in names for s in (100_000, 200_000)}
    assert all(r["ratio_vs_gradscaler"] == pytest.approx(1.0) for r in data["overhead"] if r["name"] == "GradScaler")
    assert {(r["name"], r["size"]) for r in data["fused_steps"]} == {(n, s) for n in names for s in (100_000, 200_000)}
    assert all(r["fused"] for r in data["fused_steps"]) and not any(r["fused"] for r in data["overhead"])
    assert data["meta"]["device"] == "cuda" and data["meta"]["gpu"]
    assert page.read_text(encoding="utf-8") == bench_gpu.format_markdown(data)


def test_the_page_names_the_gpu_pass_and_the_makefile_runs_it_within_8_minutes():
    """docs/bench.md (and every page the generator writes) ends with the one command of the GPU
    pass; the Makefile's ``gpu-pass`` runs the gpu-marked tests and the bench under timeouts that
    sum to at most 8 minutes."""
    root = Path(__file__).resolve().parents[2]
    assert bench_gpu.format_markdown(made_up_result()).endswith("\n".join(["", *bench_gpu.REGENERATE]))
    assert (root / "docs" / "bench.md").read_text(encoding="utf-8").endswith("\n".join(["", *bench_gpu.REGENERATE]))
    make = (root / "Makefile").read_text(encoding="utf-8")
    recipe = make.split("\ngpu-pass:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert "-m gpu tests/cuda tests/experiments/test_bench_gpu.py" in recipe[0]
    assert "-m experiments.bench.cli --device cuda" in recipe[1] and "--write-docs docs/bench.md" in recipe[1]
    assert sum(int(line.split("timeout ", 1)[1].split()[0]) for line in recipe) <= 8 * 60


def test_page_shows_the_fused_optimizer_steps_when_timed():
    result = made_up_result()
    assert "(ii b)" not in bench_gpu.format_markdown(result)  # a result without the section (older JSON)
    result["fused_steps"] = [{**r, "fused": True, "median_ms": r["median_ms"] / 2} for r in result["overhead"]]
    page = bench_gpu.format_markdown(result)
    assert "## (ii b) Full step with a fused optimizer: no host sync" in page
    section = page.split("## (ii b)", 1)[1].split("\n## ", 1)[0]
    assert "| max_ema | 0.300 / 1.20x | 3.000 / 1.20x |" in section


@pytest.mark.parametrize("name", ["GradScaler", "native", "max_ema", "layerwise", "layerwise_adaloss", "hybrid"])
def test_a_fused_optimizer_step_reads_nothing_on_the_host(name):
    """Section (ii b) times the device alone only if no call of its step reads a tensor on the host
    (on the CPU no read syncs, so a read is caught where it is asked for)."""
    params, _ = common.make_params(1000, 4)
    step = common.scaling_step(common.make_scaler(name), common.NoOpFusedOptimizer(params), torch.tensor(1.0),
                               unscale=False)
    step()  # lazy state
    with forbid_host_sync():
        for _ in range(3):
            step()


def test_page_shows_the_per_layer_rules_on_the_gpt_step_when_timed():
    result = made_up_result()
    assert "(iii)" not in bench_gpu.format_markdown(result)  # a result without the section (older JSON)
    result["hooks"] = [{"model": "gpt", "strategy": "layerwise", "plain_ms": 10.0, "attached_ms": 10.4,
                        "extra_ms": 0.4, "ratio": 1.04, "ratio_lo": 1.031, "ratio_hi": 1.052}]
    page = bench_gpu.format_markdown(result)
    assert "## (iii) Per-layer rules attached vs not on the GPT step" in page and "median ms of 7 rounds" in page
    assert "| gpt | layerwise | 10.000 | 10.400 | 0.400 | 1.040x | [1.031, 1.052] | - | - |" in page
    result["hooks"][0].update(plain_peak_mib=120.0, extra_peak_mib=3.25)
    assert "| 1.040x | [1.031, 1.052] | 120.0 | +3.2 |" in bench_gpu.format_markdown(result)
    del result["hooks"][0]["ratio_lo"]  # a JSON written before the interval: shown as "-"
    assert "| 1.040x | - |" in bench_gpu.format_markdown(result)


def test_the_gpu_section_times_section_c_with_the_given_device_and_clock():
    """bench_hooks on the CPU with a counting clock: every rule, both copies, one round each
    (the GPU section passes device "cuda" and a synchronising clock the same way)."""
    ticks = []

    def clock() -> float:
        ticks.append(1)
        return float(len(ticks))

    rows = bench_steps.bench_hooks(1, ("gpt",), device="cpu", clock=clock)
    assert [r["strategy"] for r in rows] == list(HOOKED) and {r["model"] for r in rows} == {"gpt"}
    assert len(ticks) == 2 * 2 * len(HOOKED)  # before and after each timed step, plain and attached
    assert all(r["plain_ms"] == r["attached_ms"] == 1e3 and r["ratio"] == 1.0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_bytes_is_the_most_held_at_once_on_the_gpu():
    """4 MiB and 8 MiB held together, the 4 freed, 4 more: 12 MiB at most (less than 2 MiB more
    should the caching allocator hand out a larger cached block)."""
    from experiments.bench.common import peak_bytes

    def step():
        a = torch.empty(1 << 20, device="cuda")
        b = torch.empty(2 << 20, device="cuda")
        del a
        c = torch.empty(1 << 20, device="cuda")
        return b, c

    assert 12 << 20 <= peak_bytes(step) < 14 << 20
    rows = bench_steps.bench_hooks(1, ("gpt",), device="cuda")
    assert all(r["plain_peak_mib"] > 0 and "extra_peak_mib" in r for r in rows)


def test_peak_bytes_refuses_the_cpu():
    from experiments.bench.common import peak_bytes

    with pytest.raises(ValueError, match="CUDA only"):
        peak_bytes(lambda: None, "cpu")
