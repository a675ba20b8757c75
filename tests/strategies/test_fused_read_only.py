"""Read-only statistics with fused optimizers (issue 33, item 3): when the optimizer unscales
(``grad_scale``/``found_inf`` handed to a fused Adam/AdamW/SGD, as ``torch.amp.GradScaler`` does
for ``_step_supports_amp_scaling``), every rule but the per-group ones only reads the gradients.

The reference is GradScaler's own fused path driven at the rule's scale (``update(new_scale)``
after every step): parameters and optimizer state bit-identical after every step, an overflow
step included, and the gradients the optimizer receives are the ones backward wrote. The probes
(``norm_ratio``, ``hybrid``) read the still-scaled gradients too: their scale trajectory equals
the one of the same rule unscaling first (``unscale_()`` then the fused step)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.helpers import UNSCALES_ITSELF

READERS = sorted(set(strategies.available()) - UNSCALES_ITSELF)
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}
PROBE = {"norm_ratio": {"probe_interval": 1}, "hybrid": {"probe_interval": 1}}


def _model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.randn(32, 8), torch.randn(32, 1)


def _steps(scaler, model, opt, x, y, n: int = 6, after=None, unscale_first: bool = False) -> list[list[torch.Tensor]]:
    """``n`` training steps (the third overflows); per step the gradients the optimizer received
    and the ones backward wrote. ``after(step)`` runs after each update."""
    got: list[torch.Tensor] = []
    opt.register_step_pre_hook(lambda o, a, k: got.extend(p.grad.clone() for p in model.parameters()))
    seen = []
    for step in range(n):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y) * (math.inf if step == 2 else 1.0)).backward()
        written = [p.grad.clone() for p in model.parameters()]
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if after is not None:
            after(step)
        seen.append((written, list(got)))
        got.clear()
    return seen


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("name", READERS)
def test_params_equal_gradscalers_fused_path_and_gradients_are_not_written(name: str, opt_name: str) -> None:
    model, x, y = _model()
    s = strategies.create(name, init_scale=2.0**8, **PROBE.get(name, {})).attach(model)
    s.set_reference(lambda: F.mse_loss(model(x), y))
    opt = OPTIMIZERS[opt_name](model.parameters())
    scales = []
    ours = _steps(s, model, opt, x, y, after=lambda step: scales.append(s.get_scale()))
    ref_model, _, _ = _model()
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref_opt = OPTIMIZERS[opt_name](ref_model.parameters())
    _steps(gs, ref_model, ref_opt, x, y, after=lambda step: gs.update(scales[step]))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for group, ref_group in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(group[k], ref_group[k]) for k in group)
    for written, received in ours:  # bit for bit (the overflow step's NaNs included)
        assert len(received) == len(written)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(written, received))


@pytest.mark.parametrize("name", sorted(PROBE))
def test_probes_read_scaled_gradients_as_if_unscaled(name: str) -> None:
    """The probe's mixed-precision norm of the still-scaled gradients x 1/S: the same scale
    trajectory, parameters and probe sums as unscaling first (power-of-two scales: exact)."""
    runs = []
    for unscale_first in (False, True):
        model, x, y = _model()
        s = strategies.create(name, init_scale=2.0**8, **PROBE[name]).attach(model)
        s.set_reference(lambda: F.mse_loss(model(x), y))
        opt = OPTIMIZERS["adamw"](model.parameters())
        trail = []
        _steps(s, model, opt, x, y, n=8, unscale_first=unscale_first,
               after=lambda step: trail.append(s.state.scale.clone()))
        assert int(s.state.probe_count) == 8
        runs.append((trail, [p.detach().clone() for p in model.parameters()]))
    (a, pa), (b, pb) = runs
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and len(a) == 8
    assert all(torch.allclose(p, q, rtol=0, atol=1e-7) for p, q in zip(pa, pb))


def test_per_group_rules_still_unscale_first() -> None:
    """A fused optimizer takes one grad_scale; per-group scales cannot be handed over."""
    assert {n for n in strategies.available() if strategies.get(n).per_group} <= UNSCALES_ITSELF
    assert not UNSCALES_ITSELF & {"norm_ratio", "hybrid", "native", "underflow_target"}
