"""A real package: the sdist and the wheel built from it ship ``conf/`` and the kernel sources, and
the installed console scripts train, report and build the kernels from any directory.

The wheel is built from an sdist of a copy of this checkout (so ``MANIFEST.in`` is checked too)
with this environment's setuptools, offline, and installed with ``pip install --target``; the
subprocesses then import scalelab from that target only (``PYTHONPATH``, cwd outside the checkout;
the checks below fail if the checkout's modules or folders are used instead).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from experiments.app import train
from strategies import kernel_build
from tests.experiments.runs import QUIET, TINY

REPO = Path(__file__).resolve().parents[2]  # the checkout

BUNDLED = {"conf": "experiments/conf", "cuda": "strategies/cuda"}  # checkout folder -> in the wheel
NOT_SOURCES = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "runs", "multirun",
                                     "outputs", "reports", "wandb", "tests")


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:4]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """sdist -> wheel -> ``pip install --target``; returns the paths involved."""
    tmp = tmp_path_factory.mktemp("package")
    src, dist, wheels, site = tmp / "src", tmp / "dist", tmp / "wheels", tmp / "site"
    shutil.copytree(REPO, src, ignore=NOT_SOURCES)
    build_sdist = f"import setuptools.build_meta as b; print(b.build_sdist({str(dist)!r}))"
    sdist = dist / _run([sys.executable, "-c", build_sdist], cwd=src).stdout.strip().splitlines()[-1]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(sdist)], cwd=tmp)
    (wheel,) = wheels.glob("scalelab-*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], cwd=tmp)
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return {"sdist": sdist, "wheel": wheel, "site": site, "cwd": elsewhere}


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALELAB_")}
    return dict(env, PYTHONPATH=str(site), WANDB_MODE="disabled", **extra)


def test_sdist_and_wheel_ship_conf_and_kernel_sources(installed) -> None:
    with tarfile.open(installed["sdist"]) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    in_wheel = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for folder, packaged in BUNDLED.items():
        files = _files(REPO / folder)
        assert files and {f"{folder}/{f}" for f in files} <= in_sdist
        assert {f"{packaged}/{f}" for f in files} <= in_wheel
        assert _files(installed["site"] / packaged) == files


def test_installed_scripts_train_and_report_outside_the_checkout(installed) -> None:
    site, cwd = installed["site"], installed["cwd"]
    env = _env(site, SCALELAB_KERNELS="0")
    where = _run([sys.executable, "-c", "import analysis, experiments.app.train as t, strategies.kernel_build as k; "
                  "print(analysis.__file__, t.__file__, k.__file__, t.CONF_DIR, k.source_dir(), sep='\\n')"],
                 cwd=cwd, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where

    run_dir = cwd / "run"
    job = [*TINY["mlp"], *QUIET, "precision=fp16", "strategy=native", "train.steps=5", f"hydra.run.dir={run_dir}"]
    _run([str(site / "bin" / "scalelab-train"), *job], cwd=cwd, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5, summary
    sources = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    main_conf = next(s["path"] for s in sources if s["provider"] == "main")
    assert Path(main_conf).is_relative_to(site), main_conf

    _run([str(site / "bin" / "scalelab-report"), str(run_dir), "--out", str(cwd / "report"), "--n-boot", "50"],
         cwd=cwd, env=env)
    assert (cwd / "report" / "report.md").stat().st_size > 0
    _run([str(site / "bin" / "scalelab-bench"), "--help"], cwd=cwd, env=env)


@pytest.mark.slow
def test_installed_kernels_build_from_the_installed_sources(installed, tmp_path: Path) -> None:
    site, ext = installed["site"], tmp_path / "ext"
    before = _files(site)
    probe = ("from strategies import kernel_build, kernels; ok = kernels.load(); "
             "print(ok, kernels.unavailable_reason() or '-', kernel_build.source_dir(), sep='\\n')")
    out = _run([sys.executable, "-c", probe], cwd=installed["cwd"], env=_env(site, SCALELAB_EXT_DIR=str(ext)),
               timeout=600).stdout.splitlines()
    assert out[0] == "True", out
    assert Path(out[2]).is_relative_to(site / "strategies" / "cuda")
    assert list(ext.rglob("scalelab_ops*.so"))
    assert _files(site) == before  # the build went to SCALELAB_EXT_DIR, nothing into the install


def test_env_overrides_come_first_and_a_checkout_uses_its_root_folders(monkeypatch, tmp_path: Path) -> None:
    assert train.CONF_DIR == REPO / "conf" and kernel_build.source_dir() == REPO / "cuda"
    monkeypatch.setenv("SCALELAB_CONF_DIR", str(tmp_path))
    monkeypatch.setenv("SCALELAB_CUDA_SRC", str(tmp_path))
    assert train._conf_dir() == tmp_path.resolve() and kernel_build.source_dir() == tmp_path


def test_the_ninja_dependency_is_found_without_an_activated_venv(monkeypatch) -> None:
    """torch's extension build looks for `ninja` on PATH; a venv's script run by its path (not
    activated) has the pip package's executable off PATH, so the build puts it there."""
    import shutil


    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    kernel_build.ninja_on_path()
    assert shutil.which("ninja") is not None
