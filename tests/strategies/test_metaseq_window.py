"""`tolerance` with ``window_follows_scale`` against a line-for-line restatement of metaseq's
``DynamicLossScaler`` (``metaseq/optim/dynamic_loss_scaler.py``): the growth window is multiplied by
the scale factor at each growth and divided by it at each backoff. metaseq's ``FP16Optimizer``
calls ``check_overflow`` in ``clip_grad_norm`` (an overflow raises ``OverflowError``: the step is
skipped) and ``update`` after the optimizer step (``metaseq/optim/fp16_optimizer.py``). Random
overflow sequences go through real scale/unscale_/step/update calls; the scale after every update
must equal metaseq's exactly."""

from __future__ import annotations

import random

import pytest
import torch

import strategies
from tests.strategies.drivers import run
from tests.strategies.restated import Metaseq, metaseq_trajectory


def random_case(seed: int) -> tuple[list[int], dict]:
    """Bursts of overflows between clean runs, power-of-two scales (metaseq keeps the previous
    scale below min_loss_scale, which for powers of two is the clamp)."""
    rng = random.Random(2000 + seed)
    flags: list[int] = []
    while len(flags) < 150:
        flags += [0] * rng.randint(0, 30) + [int(rng.random() < 0.7) for _ in range(rng.randint(1, 6))]
    init = 2.0 ** rng.randint(-2, 10)
    return flags, dict(init_scale=init, growth_interval=rng.choice([1, 2, 3, 5, 8]),
                       tolerance=rng.choice([0.0, 0.0, 0.25, 0.5]), threshold=rng.choice([None, None, init / 16]),
                       min_scale=rng.choice([2.0**-5, init / 4]))


@pytest.mark.parametrize("seed", range(24))
def test_equals_metaseq(seed: int) -> None:
    flags, k = random_case(seed)
    ref = Metaseq(k["init_scale"], 2.0, k["growth_interval"], k["tolerance"], k["threshold"], k["min_scale"])
    expected = metaseq_trajectory(ref, flags)
    s = strategies.create("tolerance", window_follows_scale=True, **k)
    assert run(s, flags) == (expected, None)
    assert s.telemetry()["scale_window"].item() == ref.scale_window


def test_the_window_doubles_at_each_growth_and_halves_at_each_backoff() -> None:
    """Window 2 from S = 1: growths after 2, 2 and 4 clean steps (t is not reset at growth: metaseq's
    ``(_iter - _last_overflow_iter) % scale_window``), the window then 16; an overflow halves S and
    the window (16 -> 8), and the next growth comes 8 clean steps later."""
    s = strategies.create("tolerance", init_scale=1.0, growth_interval=2, min_scale=None, window_follows_scale=True)
    scales, _ = run(s, [0] * 8 + [1] + [0] * 8)
    assert scales == [1, 2, 2, 4, 4, 4, 4, 8] + [4] * 8 + [8]
    assert s.telemetry()["scale_window"].item() == 16


def test_the_window_is_state_only_when_asked() -> None:
    plain = strategies.create("tolerance")
    plain.scale(torch.ones(()))
    assert "scale_window" not in plain.state_dict()["extra"]
    s = strategies.create("tolerance", growth_interval=7, window_follows_scale=True)
    s.scale(torch.ones(()))
    assert s.state_dict()["extra"]["scale_window"] == 7
