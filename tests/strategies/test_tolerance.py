"""`tolerance` against a line-for-line re-statement of fairseq's ``DynamicLossScaler``.

fairseq ``fairseq/optim/dynamic_loss_scaler.py``: ``check_overflow`` on an overflowing step (it
raises ``OverflowError`` — the step is skipped — or ``FloatingPointError`` at
``min_loss_scale``), ``update`` after a clean step (``fairseq/optim/fp16_optimizer.py`` calls
them in that order). Random overflow sequences go through real scale/unscale_/step/update
calls; the scale after every update must equal fairseq's exactly.
"""

from __future__ import annotations

import random

import pytest

import strategies
from tests.strategies.drivers import run
from tests.strategies.restated import Fairseq, fairseq_trajectory


def random_case(seed: int) -> tuple[list[int], dict]:
    rng = random.Random(1000 + seed)
    p = rng.choice([0.1, 0.3, 0.5, 0.8])
    flags = [int(rng.random() < p) for _ in range(rng.randint(20, 80))]
    init = 2.0 ** rng.randint(2, 12)
    return flags, dict(init_scale=init, growth_interval=rng.choice([1, 2, 3, 5, 8]),
                       tolerance=rng.choice([0.0, 0.05, 0.25, 0.5, 0.6, 1.0]),
                       threshold=rng.choice([None, None, 1.0, 4.0, init / 8]))


SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_equals_fairseq_without_floor(seed: int) -> None:
    flags, k = random_case(seed)
    ref = Fairseq(k["init_scale"], 2.0, k["growth_interval"], k["tolerance"], k["threshold"], min_loss_scale=0.0)
    expected, stopped = fairseq_trajectory(ref, flags)
    assert stopped is None
    s = strategies.create("tolerance", min_scale=None, **k)
    assert run(s, flags) == (expected, None)


@pytest.mark.parametrize("seed", SEEDS)
def test_equals_fairseq_with_min_loss_scale_raise(seed: int) -> None:
    flags, k = random_case(seed)
    k["threshold"] = None  # a threshold at or above the floor would never let fairseq raise
    min_scale = k["init_scale"] / 2.0 ** random.Random(seed).randint(1, 4)
    ref = Fairseq(k["init_scale"], 2.0, k["growth_interval"], k["tolerance"], None, min_loss_scale=min_scale)
    expected, stopped = fairseq_trajectory(ref, flags)
    s = strategies.create("tolerance", min_scale=min_scale, on_min_scale="raise", **k)
    scales, error = run(s, flags + [0])  # the fault is read at the next step()
    if stopped is None:
        assert error is None and scales[: len(flags)] == expected
    else:
        # The faulty update restores the previous scale, as fairseq; the next step() raises.
        assert scales == expected + [expected[-1] if expected else k["init_scale"]]
        assert error is not None and error.startswith(f"tolerance: step {stopped}: ")


def test_the_random_cases_reach_every_branch() -> None:
    stops, backoffs_skipped = set(), False
    for seed in SEEDS:
        flags, k = random_case(seed)
        min_scale = k["init_scale"] / 2.0 ** random.Random(seed).randint(1, 4)
        ref = Fairseq(k["init_scale"], 2.0, k["growth_interval"], k["tolerance"], None, min_loss_scale=min_scale)
        stops.add(fairseq_trajectory(ref, flags)[1] is None)
        traj = fairseq_trajectory(Fairseq(k["init_scale"], 2.0, 10**6, k["tolerance"], None, 0.0), flags)[0]
        backoffs_skipped |= sum(flags) > 0 and traj.count(k["init_scale"]) > flags.index(1) + 1
    assert stops == {True, False} and backoffs_skipped


def test_tolerance_hand_computed() -> None:
    """tolerance 0.6, no growth: overflow at r=2 (1/2 < 0.6: kept), clean, overflow at r=4 (2/4:
    kept), overflow at r=5 (3/5 >= 0.6: back off, counters restart), overflow at r=1 (1/1)."""
    s = strategies.create("tolerance", init_scale=64.0, growth_interval=100, tolerance=0.6)
    assert run(s, [0, 1, 0, 1, 1, 1]) == ([64.0, 64.0, 64.0, 64.0, 32.0, 16.0], None)
    t = s.telemetry()
    assert t["since_rescale"].item() == 1 and t["overflows_since_rescale"].item() == 0


def test_threshold_floors_the_backoff_and_growth_follows_the_window() -> None:
    s = strategies.create("tolerance", init_scale=16.0, growth_interval=2, threshold=6.0)
    assert run(s, [1, 1, 1, 0, 0, 0, 0]) == ([8.0, 6.0, 6.0, 6.0, 12.0, 12.0, 24.0], None)


def test_defaults_are_fairseqs() -> None:
    p = strategies.create("tolerance").params
    assert (p.init_scale, p.growth_interval, p.tolerance, p.threshold, p.min_scale) == (2.0**15, 2000, 0.0, None, 1e-4)


@pytest.mark.parametrize("field,value,message", [
    ("tolerance", 1.5, "tolerance must be in [0, 1], got 1.5"),
    ("threshold", -1.0, "threshold must be finite and > 0, got -1.0"),
    ("on_min_scale", "stop", "on_min_scale must be one of 'clamp', 'raise', got 'stop'"),
])
def test_new_fields_validated(field: str, value, message: str) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("tolerance", **{field: value})
    assert str(e.value) == message
