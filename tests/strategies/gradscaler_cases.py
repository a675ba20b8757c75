"""PyTorch's GradScaler test scaffolding, re-stated (``torch/testing/_internal/common_cuda.py``),
shared by the training tests (test_torch_gradscaler.py) and the API tests
(test_torch_gradscaler_api.py)."""

from __future__ import annotations

import pytest
import torch

import strategies


def presets_slow(cases: list) -> list:
    """``cases`` with the presets marked ``slow`` (for the heaviest, autocast parametrizations):
    the rules themselves stay on the CI path."""
    return [c if c.id in strategies.available() else pytest.param(*c.values, id=c.id, marks=pytest.mark.slow)
            for c in cases]

def torch_rule(s) -> bool:
    """Whether ``s`` follows torch's backoff/growth rule exactly (``native`` without hysteresis)."""
    return s.name == "native" and getattr(s.params, "hysteresis", 1) == 1

class Data(list):
    """torch's list of (input, target) batches; iterating it records the current batch, which
    the fp32 reference closure of ``norm_ratio``/``hybrid`` reads."""

    current: tuple[torch.Tensor, torch.Tensor]

    def __iter__(self):
        for item in super().__iter__():
            self.current = item
            yield item

def create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Re-stated from ``torch/testing/_internal/common_cuda.py::_create_scaling_models_optimizers``:
    a control module+optimizer and an identical one that will use scaling."""
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return mod_control, mod_scaling, optimizer_ctor(mod_control.parameters(), **kwargs), \
        optimizer_ctor(mod_scaling.parameters(), **kwargs)

def create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Re-stated from ``torch/testing/_internal/common_cuda.py::_create_scaling_case`` (seeded)."""
    torch.manual_seed(0)
    data = Data((torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4))
    return create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs) + (data, torch.nn.MSELoss(), 2)
