"""The per-layer rules with the fused boundary reads (``torch.ops.scalelab.boundary_rescale``,
``grad_extremes``, ``exponent_histogram``: one pass per crossing) against the same rules on the
plain-torch references (``kernels.boundary_applies`` off): bit-identical gradients, scales and
overflow attribution over training steps, overflows and skipped steps included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies import kernels

RULES = {"layerwise": {}, "layerwise_adaloss": {"rule": "adaloss", "init_scale": 1.0},
         "layerwise_backoff": {"rule": "backoff_growth", "growth_interval": 2}, "underflow_target": {}}


def _mlp(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())],
                                torch.nn.Linear(32, 1))
    return model, torch.randn(64, 32) * 1e-3, torch.randn(64, 1)


def _run(label: str, fused: bool, monkeypatch: pytest.MonkeyPatch,
         dtype: torch.dtype) -> tuple[list[torch.Tensor], set[str]]:
    """Six steps (the fourth overflows), fp16/bf16 autocast on the CPU: every gradient and every
    scale state after each step, then the ops that ran."""
    applies, ran = kernels.boundary_applies, set()

    def counted(op: str, grad: torch.Tensor) -> bool:
        used = fused and applies(op, grad)
        ran.update([op] if used else [])
        return used

    monkeypatch.setattr(kernels, "boundary_applies", counted)
    model, x, y = _mlp(dtype)
    name = "underflow_target" if label == "underflow_target" else "layerwise"
    s = strategies.create(name, **RULES[label]).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x).float(), y) * (math.inf if step == 3 else 1.0)
        s.scale(loss).backward()
        seen += [p.grad.clone() for p in model.parameters()]
        s.step(opt)
        s.update()
        seen += [t.clone() for t in s.state_dict().values() if isinstance(t, torch.Tensor)]
        seen.append(torch.as_tensor(s.get_scale()))
    monkeypatch.undo()
    return seen, ran


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("label", list(RULES))
def test_fused_boundary_reads_change_nothing(label: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels.available():
        pytest.skip(f"extension not built: {kernels.unavailable_reason()}")
    (fused, ran), (reference, none) = _run(label, True, monkeypatch, dtype), _run(label, False, monkeypatch, dtype)
    assert ran == ({"exponent_histogram"} if label == "underflow_target" else
                   {"boundary_rescale", "grad_extremes"} if label == "layerwise_adaloss" else {"boundary_rescale"})
    assert not none and len(fused) == len(reference)
    for a, b in zip(fused, reference):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_overflow_is_blamed_on_the_same_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Inf injected into one group's output gradient: the same groups back off either way."""
    if not kernels.available():
        pytest.skip(f"extension not built: {kernels.unavailable_reason()}")
    scales = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(kernels, "boundary_applies", lambda op, grad: False)
        model, x, y = _mlp(torch.float32)
        s = strategies.create("layerwise", init_scale=2.0**10).attach(model)
        model[4].register_full_backward_hook(lambda m, gi, go: (gi[0] * math.inf,))
        s.scale(F.mse_loss(model(x), y)).backward()
        s.step(torch.optim.SGD(model.parameters(), lr=0.1))
        s.update()
        scales.append(s.state.scale.clone())
        monkeypatch.undo()
    assert torch.equal(scales[0], scales[1]) and (scales[0] < 2.0**10).any() and (scales[0] == 2.0**10).any()
