"""cuda/bench/sweep.sh, the statistics kernel's geometry sweep: its table flags any binary whose
results differ from the base binary's, and its build makes one runnable-on-a-GPU binary per
geometry from edited copies of the kernel (nvcc only; the run itself needs a GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "cuda" / "bench"


def _table(tmp_path: Path, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "sweep.txt"
    path.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, str(BENCH / "sweep_table.py"), str(path), *args],
                          capture_output=True, text=True)


CHECK = "CHECK {v} fp16 100 finite/one grads={g} stats=5 found_inf0=0 absmax0=2 sumsq={s}"


def test_table_ranks_the_cases_and_passes_equal_results(tmp_path):
    lines = ["TIME a fp16 100 pass 0.2 2000", "TIME b fp16 100 pass 0.1 2600", "TIME a fp16 100 copy 0.1 2900",
             CHECK.format(v="a", g=1, s=1.5), CHECK.format(v="b", g=1, s=1.5000001)]
    out = _table(tmp_path, lines)
    assert out.returncode == 0, out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("  ")]
    assert [r[0] for r in rows] == ["copy", "b", "a"]  # fastest first
    assert "2 results, 0 differ from a" in out.stdout


@pytest.mark.parametrize("changed", ["grads", "sumsq"])
def test_table_fails_on_a_changed_gradient_bit_or_sum_of_squares(tmp_path, changed):
    other = CHECK.format(v="b", g=2 if changed == "grads" else 1, s=1.6 if changed == "sumsq" else 1.5)
    out = _table(tmp_path, [CHECK.format(v="a", g=1, s=1.5), other])
    assert out.returncode == 1 and "MISMATCH b" in out.stdout


def test_table_compares_against_the_named_base_and_nan_equals_nan(tmp_path):
    lines = [CHECK.format(v="a", g=1, s="nan"), CHECK.format(v="b", g=1, s="nan"), CHECK.format(v="c", g=3, s="nan")]
    out = _table(tmp_path, lines, "--base", "c")
    assert out.returncode == 1 and "2 differ from c" in out.stdout


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_build_makes_the_shipped_kernel_and_an_edited_geometry(tmp_path):
    env = {**os.environ, "GEOMETRIES": "16-256-8"}
    subprocess.run(["bash", str(BENCH / "sweep.sh"), "build", str(tmp_path)], env=env, check=True,
                   capture_output=True, text=True, timeout=600)
    assert (tmp_path / "stats_shipped").is_file() and (tmp_path / "stats_16-256-8").is_file()
    edited = (tmp_path / "stats_16-256-8.cu").read_text()
    for line in ("constexpr int kThreads = 256;", "constexpr int64_t kChunk = 1 << 16;",
                 "constexpr int64_t kMaxChunk = 1 << 16;", "constexpr int kUnroll = 8;"):
        assert line in edited
    shipped = (BENCH.parent / "kernels" / "stats_kernel.cu").read_text()
    assert (tmp_path / "stats_shipped.cu").read_text() == shipped


def test_build_refuses_a_source_whose_constants_moved(tmp_path):
    src = tmp_path / "old.cu"
    src.write_text("// no geometry constants here\n")
    env = {**os.environ, "SRC": str(src), "GEOMETRIES": "14-512-4", "SHIPPED": "0"}
    out = subprocess.run(["bash", str(BENCH / "sweep.sh"), "build", str(tmp_path / "b")], env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "could not set kThreads = 512;" in out.stderr
