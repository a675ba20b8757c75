"""Shared fixtures of the kernel tests: one extension build per session (and per xdist worker,
each loading the same cached build under torch's file lock)."""

from __future__ import annotations

import shutil

import pytest
import torch

from strategies import kernels


def _compiler_present() -> bool:
    return any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="session")
def ops() -> object:
    """``torch.ops.scalelab``, built from ``cuda/`` (skip only when no C++ compiler exists)."""
    if not _compiler_present():
        pytest.skip("no C++ compiler: the extension cannot be built (plain-torch fallback)")
    assert kernels.load(), f"extension build failed: {kernels.unavailable_reason()}"
    return torch.ops.scalelab


@pytest.fixture(scope="module")
def cuda_ops(ops):
    """``ops`` with its CUDA kernels (fails when CUDA is there and the extension has none)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("scalelab::unscale_and_stats", "CUDA"):
        pytest.fail("the extension was built without its CUDA kernels although CUDA is available")
    return ops
