"""Every .cu compiles with nvcc alone (no torch headers) for sm_80 and sm_90; the CUDA shim
passes a syntax check against torch's headers. Skipped where nvcc is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from strategies import kernel_build

NVCC = shutil.which("nvcc")
CU_FILES = sorted((kernel_build.source_dir() / "kernels").glob("*.cu"))
pytestmark = [pytest.mark.nvcc, pytest.mark.skipif(NVCC is None, reason="nvcc not found")]


def test_there_are_kernels():
    names = {f.name for f in CU_FILES}
    assert {"stats_kernel.cu", "update_kernels.cu"} <= names


@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_for_sm80_and_sm90(cu: Path, tmp_path: Path):
    cmd = [NVCC, "-c", str(cu), "-o", str(tmp_path / (cu.stem + ".o")), "-I", str(kernel_build.source_dir() / "include"),
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Werror", "all-warnings"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    sass = subprocess.run(["cuobjdump", "--list-elf", str(tmp_path / (cu.stem + ".o"))], capture_output=True,
                          text=True) if shutil.which("cuobjdump") else None
    if sass is not None and sass.returncode == 0:
        assert "sm_80" in sass.stdout and "sm_90" in sass.stdout


def _host_compile_with_cuda(tmp_path: Path, source: str, *flags: str) -> subprocess.CompletedProcess:
    """Compile torch-facing C++ of the extension as a CUDA build would (SCALELAB_WITH_CUDA, torch's
    and the toolkit's headers; a CPU-only torch lacks c10/cuda/impl/cuda_cmake_macros.h: a stub
    stands in)."""
    from torch.utils.cpp_extension import include_paths

    dry = subprocess.run([NVCC, "--dryrun", "-c", str(CU_FILES[0])], capture_output=True, text=True)
    top = [ln.split("=", 1)[1].strip() for ln in dry.stderr.splitlines() if ln.startswith("#$ TOP=")]
    assert top, dry.stderr
    cuda_inc = Path(top[0]).resolve() / "include"  # the toolkit's include folder, wherever nvcc lives
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-std=c++20", *flags, "-DSCALELAB_WITH_CUDA", "-I", str(kernel_build.source_dir() / "include"),
           "-I", str(tmp_path), "-I", str(cuda_inc), *[f"-isystem{p}" for p in include_paths()],
           str(kernel_build.source_dir() / source)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cuda_shim_syntax(tmp_path: Path):
    """The statistics pass's CUDA shim compiles against torch's c10/cuda headers and the CUDA
    runtime headers."""
    res = _host_compile_with_cuda(tmp_path, "cuda_shim.cpp", "-fsyntax-only")
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not found")
def test_update_ops_cuda_path_links(tmp_path: Path):
    """The update ops' CUDA path (cpu/update_cpu.cpp built with CUDA) compiles, and every kernel
    launcher it calls is instantiated in update_kernels.cu (a rule without its instantiation line
    would fail to load on a GPU machine; this finds it without one)."""
    obj = tmp_path / "update_ops.o"
    res = _host_compile_with_cuda(tmp_path, "cpu/update_cpu.cpp", "-c", "-O0", "-o", str(obj))
    assert res.returncode == 0, res.stderr[-4000:]
    cu = kernel_build.source_dir() / "kernels" / "update_kernels.cu"
    cu_obj = tmp_path / "update_kernels.o"
    res = subprocess.run([NVCC, "-c", str(cu), "-o", str(cu_obj), "-I", str(kernel_build.source_dir() / "include"),
                          "-arch=sm_80"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr

    needed = {sym for sym in _symbols(obj, "U") if "launch_rule" in sym}
    assert len(needed) >= 9, needed  # one per rule
    assert needed <= _symbols(cu_obj, "TtWw"), needed - _symbols(cu_obj, "TtWw")


def _symbols(path: Path, kinds: str) -> set[str]:
    out = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    return {ln.split()[-1] for ln in out.splitlines() if ln.split()[-2:-1] and ln.split()[-2] in kinds}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not found")
def test_boundary_ops_cuda_path_links(tmp_path: Path):
    """The layer-boundary ops' CUDA path (cpu/boundary_cpu.cpp built with CUDA) compiles, and
    every launcher it calls is defined in boundary_kernel.cu."""
    obj = tmp_path / "boundary_ops.o"
    res = _host_compile_with_cuda(tmp_path, "cpu/boundary_cpu.cpp", "-c", "-O0", "-o", str(obj))
    assert res.returncode == 0, res.stderr[-4000:]
    cu_obj = tmp_path / "boundary_kernel.o"
    res = subprocess.run([NVCC, "-c", str(kernel_build.source_dir() / "kernels" / "boundary_kernel.cu"), "-o",
                          str(cu_obj), "-I", str(kernel_build.source_dir() / "include"), "-arch=sm_80"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    needed = {sym for sym in _symbols(obj, "U") if "scalelab4cuda" in sym}
    assert len(needed) == 3, needed  # boundary_pass, boundary_workspace_bytes, exponent_histogram
    assert needed <= _symbols(cu_obj, "T"), needed - _symbols(cu_obj, "T")


def test_stats_kernel_geometry_in_ptx(tmp_path: Path):
    """The statistics kernel of each dtype moves 16-byte vectors (ld/st.global.v4) and takes a
    chunk table of more than 4 KiB (CUDA 12.1+'s 32 KB kernel parameters): the launch geometry
    of issue 15 A.4 survives as compiled code, not only as source."""
    import re

    cu = kernel_build.source_dir() / "kernels" / "stats_kernel.cu"
    ptx = tmp_path / "stats.ptx"
    cmd = [NVCC, "-ptx", "-arch=sm_90", "-O3", "--fmad=false", "-I", str(kernel_build.source_dir() / "include"), str(cu),
           "-o", str(ptx)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = ptx.read_text()
    entries = re.split(r"\.visible \.entry|\.entry", text)
    stats = {dt: body for body in entries for dt in ("IfE", "I6__halfE", "I13__nv_bfloat16E")
             if f"stats_kernel{dt}" in body.split("(", 1)[0]}
    assert set(stats) == {"IfE", "I6__halfE", "I13__nv_bfloat16E"}
    for dt, body in stats.items():
        assert re.search(r"ld\.global(\.\w+)*\.v4\.", body) and re.search(r"st\.global(\.\w+)*\.v4\.", body), dt
        table = int(re.search(r"_param_0\[(\d+)\]", body).group(1))
        assert table > 4096, (dt, table)
