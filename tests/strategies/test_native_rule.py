"""`native`'s optional extras (hysteresis, clamp) against hand-computed trajectories."""

from __future__ import annotations

import pytest
import torch

import strategies
from strategies.rules.native import native_update_
from tests.helpers import forbid_host_sync
from tests.strategies.drivers import drive


def test_default_is_torch_backoff_growth() -> None:
    s = strategies.create("native", init_scale=16.0, growth_interval=2)
    assert drive(s, [0, 0, 1, 0, 1, 1, 0, 0, 0]) == [16, 32, 16, 16, 8, 4, 4, 8, 8]


def test_hysteresis_megatron_semantics() -> None:
    # H=2: the first overflow after a growth only spends budget; later ones back off until growth refills it.
    s = strategies.create("native", init_scale=16.0, growth_interval=2, hysteresis=2)
    flags = [1, 1, 1, 0, 0, 1, 0, 0, 1]
    # step: 1 (h 2->1, keep 16), 1 (h->0, back off 8), 1 (h->-1, 4), 0 (t=1), 0 (t=2 grow 8, h=2),
    #       1 (h=1 keep 8, t=0), 0 (t=1), 0 (grow 16, h=2), 1 (h=1 keep)
    assert drive(s, flags) == [16, 8, 4, 4, 8, 8, 8, 16, 16]
    assert s.state_dict()["extra"]["hysteresis_tracker"] == 1


def test_hysteresis_state_round_trip() -> None:
    s = strategies.create("native", init_scale=16.0, growth_interval=2, hysteresis=3)
    drive(s, [1, 1])
    s2 = strategies.create("native", init_scale=16.0, growth_interval=2, hysteresis=3)
    s2.load_state_dict(s.state_dict())
    assert drive(s, [1, 1, 0, 0]) == drive(s2, [1, 1, 0, 0])


def test_clamp() -> None:
    s = strategies.create("native", init_scale=16.0, growth_interval=1, min_scale=4.0, max_scale=64.0)
    assert drive(s, [0, 0, 0, 0, 1, 1, 1, 1, 1]) == [32, 64, 64, 64, 32, 16, 8, 4, 4]


def test_hysteresis_validated() -> None:
    with pytest.raises(ValueError, match=r"hysteresis must be an integer >= 1, got 0"):
        strategies.create("native", hysteresis=0)


def test_hysteresis_path_rounds_like_torch() -> None:
    """Non-power-of-two factors: S * factor is taken in double and rounded once, as torch does."""
    found = [0, 1, 0, 0, 1, 1, 0]
    a = strategies.create("native", init_scale=3.0, growth_factor=1.1, backoff_factor=0.3,
                          growth_interval=1, hysteresis=1)
    # The general (hysteresis) path with a budget of one overflow must equal torch's op.
    scale, tracker, budget = torch.tensor(3.0), torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    general = []
    for f in found:
        native_update_(scale, tracker, budget, torch.tensor(float(f)), 1.1, 0.3, 1, 1)
        general.append(scale.item())
    assert general == drive(a, found)
