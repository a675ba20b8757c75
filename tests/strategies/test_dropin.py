"""Drop-in wherever GradScaler goes: type and constructor parity, frameworks' private calls, and
fused optimizers handled like GradScaler (they unscale; the strategy only reads the gradients)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.helpers import PROBING_OR_PER_GROUP, params_equal

NAMES = strategies.available()


def model_and_data(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    return model, torch.randn(16, 4, dtype=dtype), torch.randn(16, 1, dtype=dtype)


@pytest.mark.parametrize("name", NAMES)
def test_is_a_gradscaler_and_takes_the_device_first(name: str) -> None:
    s = strategies.create(name, "cpu", 2.0**10, 3.0, 0.25, 7)
    assert isinstance(s, torch.amp.GradScaler)
    assert (s.params.device, s.params.init_scale, s.get_growth_factor(), s.get_backoff_factor(),
            s.get_growth_interval()) == ("cpu", 2.0**10, 3.0, 0.25, 7)
    assert s._scale is None and s._enabled
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))  # accelerate calls this before loading state
    assert s._scale is not None and s.get_scale() == 2.0**10 and s._growth_tracker is not None
    assert math.isfinite(copy.deepcopy(s).get_scale())


def test_cuda_device_without_cuda_disables_with_gradscalers_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as got:
        torch.amp.GradScaler("cuda")
    with pytest.warns(UserWarning, match=str(got[0].message).replace(".", r"\.")):
        s = strategies.create("native", "cuda")
    assert not s.is_enabled() and s.get_scale() == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_fused_optimizer_unscales_and_the_strategy_only_reads(name: str) -> None:
    """Without unscale_(), a fused AdamW gets grad_scale and found_inf, as from GradScaler: the
    gradients reach optimizer.step still scaled (no second write over them), except for rules
    that unscale in their own pass (per-group scales, probes)."""
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    s = strategies.create(name, init_scale=2.0**6).attach(model)
    s.set_reference(lambda: F.mse_loss(model(x), y))
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(grad_scale=getattr(o, "grad_scale", None),
                                                          grads=[p.grad.clone() for p in model.parameters()]))
    s.scale(F.mse_loss(model(x), y)).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    s.step(opt)
    s.update()
    if name in PROBING_OR_PER_GROUP:
        assert seen["grad_scale"] is None and not all(torch.equal(a, b) for a, b in zip(seen["grads"], scaled))
    else:
        assert seen["grad_scale"].item() == 2.0**6 and all(torch.equal(a, b) for a, b in zip(seen["grads"], scaled))
    assert s.telemetry()["grad_absmax"].item() == pytest.approx(max(g.abs().max().item() for g in scaled) / 2.0**6)


@pytest.mark.parametrize("poison", [None, "inf"])
def test_native_with_fused_adamw_equals_gradscaler(poison: str | None) -> None:
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
                   strategies.create("native", init_scale=2.0**8, growth_interval=2)):
        model, x, y = model_and_data(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scales = []
        for step in range(6):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y) * (math.inf if poison and step == 3 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((model, scales))
    (a, sa), (b, sb) = runs
    assert sa == sb and params_equal(a, b)


@pytest.mark.parametrize("name", sorted(set(NAMES) - PROBING_OR_PER_GROUP))
def test_fp16_parameters_are_accepted_with_a_fused_optimizer_as_by_gradscaler(name: str) -> None:
    model, x, y = model_and_data(2, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    s = strategies.create(name, init_scale=2.0**4)
    s.scale(F.mse_loss(model(x), y).float()).backward()
    s.step(opt)
    s.update()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):  # unscale_ itself still refuses
        s.scale(F.mse_loss(model(x), y).float()).backward()
        s.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
