"""Every strategy (presets included) as ``accelerator.scaler`` of an fp16 ``Accelerator``: it
trains through ``accelerator.backward``, ``clip_grad_norm_`` and the ``AcceleratedOptimizer``'s
``step`` (``accelerate/optimizer.py``: ``scaler.step(optimizer, closure)`` then ``update()``,
``step_was_skipped``), skips an Inf step, and ``save_state``/``load_state`` (``scaler.pt``, the
scaler's ``state_dict``) restores it into a fresh accelerator and strategy that train on in
lockstep with the original.

accelerate 1.x gives fp16 on the CPU neither a scaler nor autocast (``accelerator.py``: the
scaler branch requires ``self.device.type != "cpu"``), so the test sets what it sets on a GPU
before ``prepare``: ``native_amp = True`` (autocast fp16 around ``forward``, and
``unscale_gradients`` in ``clip_grad_norm_``) and ``scaler`` (passed to the optimizer wrapper).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_overflow_reaction, batch, fp16_safe, make_strategy, mlp, params_equal, strategy_cases

accelerate = pytest.importorskip("accelerate")

INJECT, STEPS, MORE = 2, 4, 2


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def prepared(name: str, kw: dict):
    """A fresh fp16 Accelerator with the strategy swapped in, and its prepared model and optimizer."""
    accelerate.state.AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert acc.scaler is None and not acc.native_amp  # what the installed version does on the CPU
    model = mlp(seed=3)
    current: dict[str, torch.Tensor] = {}
    bare = model.forward  # the fp32 reference runs the bare forward: prepare() wraps it in autocast
    s = make_strategy(name, fp16_safe(kw), model, lambda: F.mse_loss(bare(current["x"]), current["y"]))
    acc.scaler, acc.native_amp = s, True
    wrapped, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    return acc, wrapped, opt, s, current


def train_step(acc, model, opt, current, step: int, poison: bool = False) -> bool:
    """One step; returns whether the optimizer skipped it."""
    opt.zero_grad()
    current["x"], current["y"] = batch(step)
    loss = F.mse_loss(model(current["x"]).float(), current["y"])
    acc.backward(loss)
    if poison:
        list(model.parameters())[-1].grad.view(-1)[0] = math.inf  # the loss-side layer
    acc.clip_grad_norm_(model.parameters(), 1.0)  # unscales first (unscale_gradients)
    opt.step()
    return opt.step_was_skipped


@pytest.mark.parametrize("name,kw", strategy_cases())
def test_accelerate_fp16_skips_an_inf_step_and_save_load_state_round_trips(name: str, kw: dict,
                                                                          tmp_path: Path) -> None:
    acc, model, opt, s, current = prepared(name, kw)
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()], s.get_scale()
        # A disabled scaler ("none") steps on Inf like GradScaler(enabled=False): not poisoned.
        skipped = train_step(acc, model, opt, current, step, poison=step == INJECT and s.is_enabled())
        moved = not all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0]))
        if not s.is_enabled():  # "none": transparent, nothing skipped (a disabled GradScaler)
            assert not skipped and moved and s.get_scale() == 1.0
            continue
        # Skipped exactly when the rule found an overflow: the injected one, and any the rule's
        # own scale caused in fp16 (the aggressive rules may overshoot after backing off).
        assert skipped == bool(s.telemetry()["found_inf"].item()) == (not moved), step
        if step == INJECT:
            assert skipped
            assert_overflow_reaction(s, s.get_scale(), before[1])
    acc.save_state(str(tmp_path / "state"))
    assert (tmp_path / "state" / "scaler.pt").exists()
    assert torch.load(tmp_path / "state" / "scaler.pt", weights_only=True) == s.state_dict()

    acc2, model2, opt2, s2, current2 = prepared(name, kw)
    acc2.load_state(str(tmp_path / "state"))
    assert s2.state_dict() == s.state_dict()
    assert params_equal(model, model2)
    for step in range(STEPS, STEPS + MORE):  # both go on identically
        assert train_step(acc, model, opt, current, step) == train_step(acc2, model2, opt2, current2, step)
        assert s2.get_scale() == s.get_scale()
    assert params_equal(model, model2) and s2.state_dict() == s.state_dict()
