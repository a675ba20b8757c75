"""Shared fixtures: one synthetic sweep (known differences) written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.analysis.synth import SweepSpec, write_sweep


@pytest.fixture(scope="session")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(sweep dir, what was written): fp16 strategies + fp32 reference + one run of each
    awkward kind (failed, diverged, incomplete with a corrupt line, no records)."""
    root = tmp_path_factory.mktemp("analysis") / "synthetic"
    info = write_sweep(root, SweepSpec())
    return root, info
