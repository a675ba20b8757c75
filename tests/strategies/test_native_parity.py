"""`native` is indistinguishable from torch.amp.GradScaler("cpu") on real training runs.

Both scalers drive identical models through identical loops; every scale value, every skip
decision, every parameter and every optimizer-state tensor must be bit-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

import strategies
from tests.helpers import batch, forbid_host_sync, mlp, optimizer_state_equal, params_equal


@dataclasses.dataclass
class Setting:
    precision: str = "fp32"  # fp32 | fp16 (CPU autocast)
    optimizer: str = "sgd"  # sgd | adam | adam_fused
    steps: int = 14
    inject: dict[int, str] = dataclasses.field(default_factory=dict)  # step -> "nan" | "inf"
    two_optimizers: bool = False
    accumulate: int = 1
    clip: float | None = None
    roundtrip_at: int | None = None
    loss_mult: float = 1.0
    scaler: dict[str, Any] = dataclasses.field(default_factory=dict)


def make_optimizers(model: torch.nn.Module, s: Setting) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    groups = [params[: len(params) // 2], params[len(params) // 2 :]] if s.two_optimizers else [params]
    if s.optimizer == "sgd":
        return [torch.optim.SGD(g, lr=0.05, momentum=0.9) for g in groups]
    return [torch.optim.Adam(g, lr=1e-3, fused=s.optimizer == "adam_fused") for g in groups]


def train(make_scaler: Callable[[], Any], s: Setting):
    model = mlp(seed=0)
    opts = make_optimizers(model, s)
    stepped: list[int] = []
    for i, o in enumerate(opts):
        o.register_step_post_hook(lambda *_a, i=i: stepped.append(i))
    scaler = make_scaler()
    scales, steps_taken = [], []
    for step in range(s.steps):
        for o in opts:
            o.zero_grad()
        for micro in range(s.accumulate):
            x, y = batch(step * 10 + micro)
            with torch.autocast("cpu", dtype=torch.float16, enabled=s.precision == "fp16"):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) * s.loss_mult / s.accumulate
            scaler.scale(loss).backward()
        if step in s.inject:
            p = next(model.parameters())
            p.grad.view(-1)[3] = float("nan") if s.inject[step] == "nan" else float("inf")
        if s.clip is not None:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        before = len(stepped)
        for o in opts:
            scaler.step(o)
        scaler.update()
        steps_taken.append(len(stepped) - before)
        scales.append(scaler.get_scale())
        if s.roundtrip_at == step:
            sd = scaler.state_dict()
            scaler = make_scaler()
            scaler.load_state_dict(sd)
    return model, opts, scales, steps_taken


SETTINGS = {
    "fp32-sgd-default": Setting(),
    "fp16-adam": Setting(precision="fp16", optimizer="adam"),
    "fp16-sgd-inject": Setting(precision="fp16", inject={2: "nan", 3: "inf", 9: "inf"},
                               scaler=dict(growth_interval=3)),
    "fp32-adam-interval1": Setting(optimizer="adam", inject={4: "inf"}, scaler=dict(growth_interval=1)),
    "two-optimizers": Setting(two_optimizers=True, inject={5: "nan"}, scaler=dict(growth_interval=2)),
    "two-optimizers-adam-fp16": Setting(precision="fp16", optimizer="adam", two_optimizers=True,
                                        inject={1: "inf"}, scaler=dict(growth_interval=2)),
    "accumulate": Setting(accumulate=3, inject={6: "inf"}, scaler=dict(growth_interval=2)),
    "clip-after-unscale": Setting(clip=0.5, inject={3: "nan"}, scaler=dict(growth_interval=2)),
    "clip-fp16-adam-two-opt": Setting(precision="fp16", optimizer="adam", clip=0.1,
                                      two_optimizers=True, scaler=dict(growth_interval=1)),
    "roundtrip-mid-run": Setting(roundtrip_at=6, inject={4: "inf", 9: "nan"},
                                 scaler=dict(growth_interval=2)),
    # Scale near the float32 maximum: growth to inf is rejected, overflows back off.
    "near-f32-max-growth-rejected": Setting(loss_mult=1e-35, scaler=dict(init_scale=2.0**126, growth_interval=1)),
    "near-f32-max-overflow": Setting(precision="fp16", scaler=dict(init_scale=2.0**127, growth_interval=1)),
    # Fused optimizers skip on the device from found_inf (no host sync in step()).
    "fused-adam-inject": Setting(optimizer="adam_fused", inject={3: "inf", 4: "nan"},
                                 scaler=dict(growth_interval=2)),
    "custom-factors": Setting(optimizer="adam", inject={2: "inf", 7: "inf"},
                              scaler=dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.25,
                                          growth_interval=2)),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_native_matches_torch_gradscaler(name: str) -> None:
    s = SETTINGS[name]
    ref = train(lambda: torch.amp.GradScaler("cpu", **s.scaler), s)
    got = train(lambda: strategies.create("native", **s.scaler), s)
    m_ref, o_ref, scales_ref, taken_ref = ref
    m_got, o_got, scales_got, taken_got = got
    assert scales_got == scales_ref
    assert taken_got == taken_ref
    assert params_equal(m_got, m_ref)
    for a, b in zip(o_got, o_ref):
        assert optimizer_state_equal(a, b)
    # The setting exercised what it claims to.
    # torch skips per optimizer (only the one holding the bad gradient); a fused optimizer's
    # step() is always called and skips inside, so there the backoff shows the skip instead.
    if s.inject and s.optimizer != "adam_fused":
        assert min(taken_ref) < len(o_ref)
    if s.inject:
        assert any(b < a for a, b in zip(scales_ref, scales_ref[1:]))
    assert all(torch.isfinite(p).all() for p in m_got.parameters())


def test_near_f32_max_really_rejects_growth() -> None:
    """The growth-rejection setting does hit the float32 ceiling (so the parity above means something)."""
    s = SETTINGS["near-f32-max-growth-rejected"]
    _, _, scales, taken = train(lambda: strategies.create("native", **s.scaler), s)
    assert scales[0] == 2.0**127 and scales[-1] == 2.0**127
    assert all(t == 1 for t in taken)


def test_native_loads_gradscaler_state_and_back() -> None:
    """A GradScaler checkpoint loads into `native` and vice versa, mid-run, with identical results."""
    s = Setting(steps=10, inject={2: "inf"}, scaler=dict(growth_interval=2))

    class Swap:
        """Starts as one scaler type; after step 5 continues as the other, via state_dict."""

        def __init__(self, first: Callable[[], Any], second: Callable[[], Any]):
            self.inner, self.second, self.n = first(), second, 0

        def __getattr__(self, k: str) -> Any:
            return getattr(self.inner, k)

        def update(self, *a: Any) -> None:
            self.inner.update(*a)
            self.n += 1
            if self.n == 5:
                sd = self.inner.state_dict()
                self.inner = self.second()
                self.inner.load_state_dict(sd)

    torch_sc = lambda: torch.amp.GradScaler("cpu", **s.scaler)  # noqa: E731
    native = lambda: strategies.create("native", **s.scaler)  # noqa: E731
    ref = train(torch_sc, s)
    for first, second in ((torch_sc, native), (native, torch_sc)):
        got = train(lambda: Swap(first, second), s)
        assert got[2] == ref[2]
        assert params_equal(got[0], ref[0])


def test_update_new_scale_matches_torch() -> None:
    for make in (lambda: torch.amp.GradScaler("cpu"), lambda: strategies.create("native")):
        sc = make()
        sc.scale(torch.ones(()))
        sc.update(new_scale=123.0)
        assert sc.get_scale() == 123.0
        sc.update(new_scale=torch.tensor(7.0))
        assert sc.get_scale() == 7.0
        with pytest.raises(AssertionError):
            sc.update(new_scale=torch.ones(2))


def test_fused_optimizer_step_does_not_sync() -> None:
    model = mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    s = strategies.create("native")
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        with forbid_host_sync():
            s.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 1:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            s.step(opt)
            s.update()
    assert s.telemetry()["skipped_steps"].item() == 1
