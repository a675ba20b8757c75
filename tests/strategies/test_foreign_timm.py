"""Every strategy (presets included) inside timm's ``NativeScaler`` (``timm/utils/cuda.py``), in
place of the ``torch.amp.GradScaler`` it holds as ``_scaler``: ``scale(loss).backward(
create_graph=...)``, then with ``clip_grad`` ``unscale_`` + ``dispatch_clip_grad`` on the
unscaled gradients, ``step`` and ``update``. Checked: the optimizer steps on exactly the
gradients of an fp32 twin clipped to ``clip_grad`` (so clipping saw unscaled gradients), and an
Inf loss is skipped with the rule's reaction.

timm needs torchvision; its PyPI wheels are CUDA builds that do not import with the CPU torch
(``operator torchvision::nms does not exist``), so on the CPU these tests skip unless a matching
torchvision is installed (see the ``timm`` extra in ``pyproject.toml``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_overflow_reaction, batch, fp16_safe, make_strategy, mlp, strategy_cases

try:
    from timm.utils import NativeScaler
except (ImportError, RuntimeError) as e:  # RuntimeError: a torchvision built for another torch
    pytest.skip(f"timm is not importable here: {type(e).__name__}: {e}", allow_module_level=True)

INJECT, STEPS, CLIP = 2, 5, 1.0
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return F.mse_loss(model(x), 10 * y)  # gradient norms well above CLIP: clipping acts


@pytest.mark.parametrize("name,kw", strategy_cases())
def test_timm_native_scaler_clips_unscaled_gradients_and_skips_inf(name: str, kw: dict) -> None:
    model, twin = mlp(seed=4), mlp(seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ns = NativeScaler(device="cpu")
    assert isinstance(ns._scaler, torch.amp.GradScaler)
    step_now = 0
    ns._scaler = s = make_strategy(name, fp16_safe(kw), model, lambda: loss_of(model, step_now))
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in model.parameters()]))
    for step_now in range(STEPS):
        twin.load_state_dict(model.state_dict())
        expected = torch.autograd.grad(loss_of(twin, step_now), list(twin.parameters()))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected]))
        assert norm > 2 * CLIP
        expected = [g * (CLIP / (norm + 1e-6)) for g in expected]  # clip_grad_norm_'s factor
        before, scale = [p.detach().clone() for p in model.parameters()], s.get_scale()
        poison = step_now == INJECT and s.is_enabled()  # a disabled scaler steps on Inf (GradScaler)
        opt.zero_grad()
        loss = loss_of(model, step_now) * (math.inf if poison else 1.0)
        ns(loss, opt, clip_grad=CLIP, clip_mode="norm", parameters=model.parameters(), create_graph=True)
        stepped = len(seen) == step_now + 1 - (step_now > INJECT and s.is_enabled())
        moved = not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        if poison:
            assert not stepped and not moved
            assert s.telemetry()["found_inf"].item() == 1
            assert_overflow_reaction(s, s.get_scale(), scale)
            continue
        assert stepped and moved, step_now
        for got, want in zip(seen[-1], expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert math.isfinite(s.get_scale()) and s.get_scale() > 0
