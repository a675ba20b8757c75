"""The kernel build folder: a lock left by a killed build is cleared instead of waited on forever,
a live build's lock is kept, and two checkouts with different sources build in different folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strategies import kernel_build

__all__: list[str] = []

REPO = Path(__file__).resolve().parents[2]
LOAD = "from strategies import kernels; print(kernels.load(), kernels.unavailable_reason() or '-')"


def _age(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    for f in [folder, *folder.iterdir()]:
        os.utime(f, (then, then))


def test_a_lock_in_a_folder_untouched_for_longer_than_the_limit_is_removed_with_a_warning(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()
    (tmp_path / "build.ninja").write_text("rule cc\n")
    _age(tmp_path, 700)
    with pytest.warns(RuntimeWarning, match="removed the kernel build lock"):
        assert kernel_build.clear_stale_lock(tmp_path, stale_s=600)
    assert not (tmp_path / "lock").exists() and (tmp_path / "build.ninja").exists()


def test_a_live_build_keeps_its_lock(tmp_path: Path, recwarn) -> None:
    (tmp_path / "lock").touch()
    _age(tmp_path, 700)
    (tmp_path / "ops.o").write_bytes(b"\0")  # the build wrote an object a moment ago
    assert not kernel_build.clear_stale_lock(tmp_path, stale_s=600)
    assert (tmp_path / "lock").exists() and not recwarn.list


def test_no_lock_nothing_to_do(tmp_path: Path) -> None:
    (tmp_path / "build.ninja").write_text("rule cc\n")
    _age(tmp_path, 7000)
    assert not kernel_build.clear_stale_lock(tmp_path, stale_s=600)


def test_two_source_folders_build_in_two_folders(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SCALELAB_EXT_DIR", raising=False)
    monkeypatch.setenv("SCALELAB_CUDA_SRC", str(REPO / "cuda"))
    here = kernel_build.build_directory(False)
    monkeypatch.setenv("SCALELAB_CUDA_SRC", str(tmp_path))
    assert kernel_build.build_directory(False) != here
    assert kernel_build.build_directory(False).parent == here.parent


def test_kernels_load_after_a_killed_build_instead_of_hanging(ops, tmp_path: Path) -> None:
    """A copy of this machine's finished build with a lock from a build killed 20 minutes ago:
    a fresh process loads the extension (before the fix it waited on the lock until the timeout)."""
    build = kernel_build.build_directory(False)
    root = tmp_path / "ext"
    shutil.copytree(build, root / "cpu")
    (root / "cpu" / "lock").touch()
    _age(root / "cpu", 1200)
    env = {**os.environ, "SCALELAB_EXT_DIR": str(root), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-W", "always", "-c", LOAD], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.stdout.split() == ["True", "-"], out.stderr[-2000:]
    assert "removed the kernel build lock" in out.stderr and not (root / "cpu" / "lock").exists()
