"""`static` (seed 003 §1): a hand-computed trajectory table and its validation."""

from __future__ import annotations

import pytest

import strategies
from tests.strategies.drivers import drive


def test_default_scale_is_1024() -> None:
    assert strategies.create("static").get_scale() == 1024.0


# found_inf per step -> the scale after each update, and the skipped-step count.
TABLE = [
    # (init, found flags, scales after each update, skipped)
    (1024.0, [0, 0, 0], [1024.0] * 3, 0),
    (1024.0, [1, 1, 1, 1], [1024.0] * 4, 4),  # overflow: skipped, S unchanged (no backoff)
    (8.0, [0, 1, 0, 0, 1, 0], [8.0] * 6, 2),  # clean steps never grow it either
]


@pytest.mark.parametrize("init,flags,scales,skipped", TABLE)
def test_trajectory_table(init: float, flags: list[int], scales: list[float], skipped: int) -> None:
    s = strategies.create("static", init_scale=init, growth_interval=1)
    assert drive(s, flags) == scales
    assert s.telemetry()["skipped_steps"].item() == skipped
    assert s.state_dict()["skipped_steps"] == skipped


def test_bounds_refuse_a_fixed_scale_outside_them_and_manual_update_sets_it() -> None:
    with pytest.raises(ValueError, match=r"^init_scale must be within \[min_scale=None, max_scale=256.0\], got 1024.0$"):
        strategies.create("static", init_scale=1024.0, max_scale=256.0)
    s = strategies.create("static", init_scale=256.0, max_scale=256.0)
    assert drive(s, [0, 1, 0]) == [256.0, 256.0, 256.0]
    s.update(64.0)
    assert drive(s, [1, 0]) == [64.0, 64.0]


def test_init_scale_validated() -> None:
    with pytest.raises(ValueError, match=r"^init_scale must be finite and > 0, got -2.0$"):
        strategies.create("static", init_scale=-2.0)
