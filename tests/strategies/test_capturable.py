"""Issue 33, item 4 on the CPU: every strategy's whole step with a fused optimizer is ready for one
CUDA graph (``tests/capture.py`` says what that takes) unless ``capture_blocker`` names why not,
and for those the blocker is real. The GPU capture itself: ``tests/cuda/test_capture_step.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.capture import MULTS, capture_cases, probing, train_steps
from tests.helpers import batch, forbid_host_sync, fp16_safe, make_strategy, mlp

WARM = 2  # steps before the trace must repeat: lazy state, caches, the first statistics


def _run(name: str, kw: dict, **overrides) -> tuple[list, object]:
    model = mlp(seed=0)
    x, y = batch(0)

    def loss() -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x), y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = make_strategy(name, fp16_safe(kw), model, loss, **overrides)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        traces = train_steps(s, loss, opt, torch.ones(()), forbid_host_sync)
    return traces, s


CAPTURABLE, BLOCKED = capture_cases()


def test_most_strategies_are_capturable() -> None:
    """The list the GPU test captures: every rule and preset but the probing rules and the presets
    that raise at their floor (``capture_blocker``)."""
    assert {c.id for c in BLOCKED} == {"hybrid", "norm_ratio", "deepspeed", "deepspeed_consecutive", "fairseq",
                                       "fairseq_tolerance", "min_scale_1e-10", "oat"}
    assert len(CAPTURABLE) >= 20


@pytest.mark.parametrize("name,kw", CAPTURABLE)
def test_whole_step_repeats_the_same_ops_with_the_skip_on_the_device(name: str, kw: dict) -> None:
    traces, s = _run(name, kw)
    steady = traces[WARM:]
    assert all(t == steady[0] for t in steady), f"{name}: the dispatched ops differ between steps"
    assert not any(op == "aten.lift_fresh.default" for op, _ in steady[0]), f"{name}: builds a tensor from host data"
    if name != "none" and "skipped_steps" in s.telemetry():
        assert int(s.telemetry()["skipped_steps"]) == MULTS.count(float("inf"))


@pytest.mark.parametrize("name,kw", BLOCKED)
def test_blockers_are_real(name: str, kw: dict) -> None:
    traces, _ = _run(name, kw, **({"probe_interval": 2} if probing(name) else {}))
    steady = traces[WARM:]
    assert any(t != steady[0] for t in steady), f"{name}: listed as not capturable, yet every step dispatched the same ops"
