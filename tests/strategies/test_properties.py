"""Property-based checks over every registered strategy (a new one is covered with no edit).

Random sequences of steps whose gradients are finite, huge, tiny, zero, NaN or Inf — injected
either into the whole loss or inside the network, below its first layer — must keep every
scale finite, positive and inside [min_scale, max_scale] (with statistics tracking on and off); a step is skipped exactly when its
gradients are non-finite; a skipped step leaves parameters and optimizer state bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies

NAMES = strategies.available()
MAGNITUDE = {"finite": 1.0, "huge": 1e35, "tiny": 1e-35, "zero": 0.0, "nan": math.nan, "inf": math.inf}
BOUNDS = (2.0**6, 2.0**14)  # within reach of init 2^10 in a few steps
# Strategy-specific keywords that make the rule act within a short sequence.
EXTRA: dict[str, dict] = {"norm_ratio": {"probe_interval": 2}}

# Finite steps weighted up so that runs of them reach the scale bounds.
KINDS = ["finite"] * 5 + sorted(set(MAGNITUDE) - {"finite"})
STEPS = st.lists(st.tuples(st.sampled_from(["loss", "inner"]), st.sampled_from(KINDS)), min_size=1, max_size=14)


class Inject(torch.nn.Module):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Times.apply(x, self)


class _Times(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):  # type: ignore[override]
        ctx.mod = mod
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.mod.factor, None


def scales_of(s) -> list[float]:
    t = s.telemetry()
    return (t["scales"] if "scales" in t else t["scale"].reshape(1)).tolist()


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS, bounded=st.booleans(), track_stats=st.booleans())
def test_random_gradient_sequences_keep_the_invariants(name: str, steps, bounded: bool, track_stats: bool) -> None:
    torch.manual_seed(0)
    inject = Inject()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), inject, torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lo, hi = BOUNDS if bounded else (None, None)
    s = strategies.create(name, init_scale=2.0**10, growth_interval=1, min_scale=lo, max_scale=hi,
                          track_stats=track_stats, **EXTRA.get(name, {}))
    s.attach(model)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss_factor = {"v": 1.0}
    s.set_reference(lambda: F.mse_loss(model(x), y) * loss_factor["v"])
    skipped = 0
    for where, kind in steps:
        loss_factor["v"] = MAGNITUDE[kind] if where == "loss" else 1.0
        inject.factor = MAGNITUDE[kind] if where == "inner" else 1.0
        opt.zero_grad()
        s.scale(F.mse_loss(model(x), y) * loss_factor["v"]).backward()
        bad = any(not torch.isfinite(p.grad).all() for p in model.parameters())
        params = [p.detach().clone() for p in model.parameters()]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        s.step(opt)
        s.update()
        skipped += bad
        tel = s.telemetry()
        assert tel["skipped_steps"].item() == skipped
        assert tel["found_inf"].item() == float(bad)
        if bad:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            after = opt.state_dict()["state"]
            assert after.keys() == state.keys()
            assert all(torch.equal(after[k][n], state[k][n]) for k in state for n in state[k])
        for v in scales_of(s):
            assert math.isfinite(v) and v > 0, (name, v)
            if bounded:
                assert lo <= v <= hi, (name, v)
    taken = len(steps) - skipped  # every finite step reached the optimizer: Adam counted it
    if taken:
        assert all(opt.state[p]["step"].item() == taken for p in model.parameters())
