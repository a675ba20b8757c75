"""Building the ``cuda/`` extension: sources, build folder, compiler flags, architectures.

:func:`strategies.kernels.load` calls :func:`build` once per machine class: it compiles the sources
of ``cuda/`` with ``torch.utils.cpp_extension.load`` (the CPU twin always; the ``.cu`` kernels and
their CUDA shim too when torch has CUDA and ``nvcc`` is found) into a stable per-machine-class build
directory. Later processes reuse the build (torch's file lock makes concurrent first builds, e.g.
under pytest-xdist, safe). The recipe follows pytorch/extension-cpp.

Environment:

* ``SCALELAB_EXT_DIR`` — build root (``cpu/`` and ``cuda/`` builds beneath it; default
  ``~/.cache/scalelab/ext/<torch>-<cpu|cuXY>-<isa>-<python>-src<hash of the source folder's path>``,
  so two checkouts with different ``cuda/`` sources keep a build each instead of rebuilding
  each other's).
* ``SCALELAB_EXT_LOCK_STALE_S`` — torch's build lock (``<build dir>/lock``) outlives a build that
  was killed, and every later build then waits on it forever. A lock is taken as stale, removed
  and named in one warning when nothing in the build folder has changed for this many seconds
  (default 600: compiling one source takes a minute or two; :func:`clear_stale_lock`).
* ``SCALELAB_CUDA_SRC`` — the ``cuda/`` source folder to build from (default: the copy a wheel
  or ``pip install .`` ships as ``strategies/cuda``; in a checkout or editable install,
  ``<repo>/cuda``). The build itself always goes to the build root above, never beside the sources.
* ``SCALELAB_KERNELS_VERBOSE=1`` — show the compiler output.
* ``TORCH_CUDA_ARCH_LIST`` — as for any torch extension, with two exceptions, each named in one
  warning: entries before Volta (sm_70: the statistics kernel passes its chunk table as one
  32 KB kernel parameter) and entries the installed ``nvcc`` cannot compile are left out, and
  the rest is built (:func:`build_arch_list`); with none left, the CPU ops are built alone.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

__all__ = ["LOCK_STALE_S", "MIN_CAPABILITY", "build", "build_arch_list", "build_directory", "clear_stale_lock", "isa",
           "ninja_on_path", "nvcc_archs", "source_dir", "use_cuda"]

_X86_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

MIN_CAPABILITY = (7, 0)
"""Volta: the oldest GPU that takes the statistics kernel's 32 KB parameter (with a CUDA 12.1+ driver)."""
LOCK_STALE_S = 600.0
"""Seconds without a change in the build folder after which its lock is taken as left by a killed build."""
_PRE_VOLTA_NAMES = ("Kepler+Tesla", "Kepler", "Maxwell+Tegra", "Maxwell", "Pascal")  # torch's named arches


def source_dir() -> Path:
    """The ``cuda/`` source folder the extension is built from: ``SCALELAB_CUDA_SRC``, else the copy
    an installed wheel ships in this package (``strategies/cuda``), else ``<checkout>/cuda``."""
    env = os.environ.get("SCALELAB_CUDA_SRC")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    return here / "cuda" if (here / "cuda").is_dir() else here.parent / "cuda"


def isa() -> str:
    """The CPU instruction set the CPU ops are compiled for: ``AVX512``, ``AVX2`` or ``generic``."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _X86_FLAGS else "generic"


def use_cuda() -> bool:
    """Whether to build the CUDA kernels: torch has CUDA, a GPU is visible and the CUDA toolkit found."""
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None


def build_directory(with_cuda: bool | None = None) -> Path:
    """Stable build folder, one per (torch version, CUDA or not, CPU instruction set, Python, source folder)."""
    if with_cuda is None:
        with_cuda = use_cuda()
    env = os.environ.get("SCALELAB_EXT_DIR")
    if env:
        return Path(env) / ("cuda" if with_cuda else "cpu")
    dev = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda else "cpu"
    src = hashlib.sha1(str(source_dir().resolve()).encode()).hexdigest()[:8]
    tag = (f"torch{torch.__version__.split('+')[0]}-{dev}-{isa().lower()}-py{sys.version_info[0]}{sys.version_info[1]}"
           f"-src{src}")
    return Path.home() / ".cache" / "scalelab" / "ext" / tag


def clear_stale_lock(build_dir: Path, stale_s: float | None = None) -> bool:
    """Remove ``build_dir/lock`` when nothing in ``build_dir`` (the lock included) changed for
    ``stale_s`` seconds (default ``SCALELAB_EXT_LOCK_STALE_S`` or :data:`LOCK_STALE_S`): a live
    build writes its objects and ninja log as it goes, a killed one leaves the lock behind and
    torch's ``FileBaton`` would wait on it forever. Returns whether a lock was removed."""
    lock = build_dir / "lock"
    if stale_s is None:
        stale_s = float(os.environ.get("SCALELAB_EXT_LOCK_STALE_S", LOCK_STALE_S))
    try:
        newest = max(f.stat().st_mtime for f in build_dir.iterdir())
        if not lock.exists() or time.time() - newest < stale_s:
            return False
        lock.unlink()
    except (FileNotFoundError, ValueError):  # the build finished (or the folder emptied) meanwhile
        return False
    warnings.warn(f"scalelab: removed the kernel build lock {lock}: nothing in its folder changed for "
                  f"{stale_s:.0f} s, so the build that took it was killed (SCALELAB_EXT_LOCK_STALE_S)",
                  RuntimeWarning, stacklevel=3)
    return True


def _sources(with_cuda: bool) -> list[str]:
    src = source_dir()
    files = [src / "ops.cpp", *sorted((src / "cpu").glob("*.cpp"))]
    if with_cuda:
        files += [src / "cuda_shim.cpp", *sorted((src / "kernels").glob("*.cu"))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"scalelab extension sources not found: {missing} (set SCALELAB_CUDA_SRC)")
    return [str(f) for f in files]


def ninja_on_path() -> None:
    """torch builds with the ``ninja`` executable found on PATH; the ``ninja`` package (a
    dependency) ships one in its own folder, which is not on PATH when a venv's script is run
    without activating the venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = str(ninja.BIN_DIR) + os.pathsep + os.environ.get("PATH", "")


def nvcc_archs() -> tuple[str, set[str]] | None:
    """(nvcc's version, the compute capabilities it compiles for, e.g. {"75", "80"}), or None if unknown."""
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc") or (cpp_extension.CUDA_HOME and str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"))
    try:
        archs = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
        version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, TypeError):
        return None
    found = set(re.findall(r"compute_(\d+)", archs))
    release = re.search(r"release (\S+),", version)
    return (release.group(1) if release else "?", found) if found else None


def build_arch_list(requested: str, nvcc: tuple[str, set[str]] | None) -> tuple[str, list[str]]:
    """The ``TORCH_CUDA_ARCH_LIST`` to build with, from the requested one: (kept entries joined
    by ';', the dropped ones each with its reason). Raises ``RuntimeError`` when none is left."""
    kept: list[str] = []
    dropped: list[str] = []
    for entry in requested.replace(";", " ").split():
        num = re.fullmatch(r"(\d+)\.(\d+)(\+PTX)?", entry)
        if entry in _PRE_VOLTA_NAMES or (num and (int(num[1]), int(num[2])) < MIN_CAPABILITY):
            dropped.append(f"{entry} (before Volta: the statistics kernel's 32 KB parameter needs sm_70 or newer)")
        elif num and nvcc is not None and f"{num[1]}{num[2]}" not in nvcc[1]:
            dropped.append(f"{entry} (nvcc {nvcc[0]} cannot compile for it)")
        else:
            kept.append(entry)
    if not kept:
        raise RuntimeError(f"TORCH_CUDA_ARCH_LIST={requested!r} has no architecture the CUDA kernels can be "
                           f"built for: {', '.join(dropped)}")
    return ";".join(kept), dropped


def build(with_cuda: bool) -> None:
    """Compile (or find already compiled) and load the extension library; raises on a failed build.
    ``TORCH_CUDA_ARCH_LIST`` is filtered by :func:`build_arch_list` for the build and restored after."""
    from torch.utils import cpp_extension

    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if with_cuda and requested is not None:
        arch, dropped = build_arch_list(requested, nvcc_archs())
        if dropped:
            warnings.warn(f"scalelab: TORCH_CUDA_ARCH_LIST entries left out of the kernel build: {'; '.join(dropped)}"
                          f"; building for {arch}", RuntimeWarning, stacklevel=4)
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    build_dir = build_directory(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    ninja_on_path()
    cflags = ["-O3", "-ffp-contract=off", "-fopenmp", *_X86_FLAGS.get(isa(), [])]
    if with_cuda:
        cflags.append("-DSCALELAB_WITH_CUDA")
    verbose = os.environ.get("SCALELAB_KERNELS_VERBOSE") == "1"
    if not (build_dir / "scalelab_ops.so").exists():
        print(f"scalelab: building the kernel extension in {build_dir} (once, about a minute)", file=sys.stderr)
    try:
        cpp_extension.load(
            name="scalelab_ops",
            sources=_sources(with_cuda),
            extra_cflags=cflags,
            extra_cuda_cflags=["-O3", "--fmad=false", "-DSCALELAB_WITH_CUDA"],
            extra_include_paths=[str(source_dir() / "include")],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if requested is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = requested
