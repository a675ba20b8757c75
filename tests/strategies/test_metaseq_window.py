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


class Metaseq:
    """metaseq's ``DynamicLossScaler``, ``update``, ``_decrease_loss_scale`` and ``check_overflow`` as written."""

    def __init__(self, init_scale=4.0, scale_factor=2.0, scale_window=256, tolerance=0.0, threshold=None,
                 min_loss_scale=2**-5):
        self.loss_scale, self.scale_factor, self.scale_window = init_scale, scale_factor, scale_window
        self.tolerance, self.threshold = tolerance, threshold
        self._iter, self._last_overflow_iter, self._last_rescale_iter = 0, -1, -1
        self._overflows_since_rescale = 0
        self.min_loss_scale = min_loss_scale

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
            self.scale_window *= self.scale_factor
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        self.scale_window = max(int(self.scale_window / self.scale_factor), 1)
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, overflow):
        if overflow:
            prev_scale = self.loss_scale
            iter_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale < self.min_loss_scale:
                self.loss_scale = prev_scale
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


def metaseq_trajectory(ref: Metaseq, flags: list[int]) -> list[float]:
    out = []
    for f in flags:
        try:
            ref.check_overflow(bool(f))
            ref.update()
        except OverflowError:
            pass
        out.append(ref.loss_scale)
    return out


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
