"""The Strategy contract, checked for every registered strategy (a new one is covered automatically)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import strategies
from tests.helpers import (FIXED_SCALE, assert_backed_off, batch, forbid_host_sync, mlp, optimizer_state_equal,
                           params_equal)

NAMES = strategies.available()


def setup(name: str, optimizer: str = "adam", **kwargs):
    model = mlp(seed=1)
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=1e-2)
    return model, opt, strategies.create(name, **kwargs)


def backward(model: torch.nn.Module, strategy, step: int, poison: str | None = None) -> None:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    strategy.scale(loss).backward()
    if poison is not None:
        p = list(model.parameters())[-1]
        p.grad.view(-1)[0] = float(poison)


def one_step(model, opt, strategy, step: int, poison: str | None = None) -> None:
    opt.zero_grad()
    backward(model, strategy, step, poison)
    strategy.step(opt)
    strategy.update()


@pytest.mark.parametrize("name", NAMES)
class TestStateMachine:
    def test_unscale_twice_raises(self, name: str) -> None:
        model, opt, s = setup(name)
        backward(model, s, 0)
        s.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            s.unscale_(opt)

    def test_unscale_after_step_raises(self, name: str) -> None:
        model, opt, s = setup(name)
        backward(model, s, 0)
        s.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            s.unscale_(opt)

    def test_step_twice_raises(self, name: str) -> None:
        model, opt, s = setup(name)
        backward(model, s, 0)
        s.step(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            s.step(opt)

    def test_calls_before_scale_raise(self, name: str) -> None:
        model, opt, s = setup(name)
        with pytest.raises(AssertionError, match="scale"):
            s.unscale_(opt)
        with pytest.raises(AssertionError, match="scale"):
            s.update()

    def test_stage_resets_after_update(self, name: str) -> None:
        model, opt, s = setup(name)
        for step in range(3):
            opt.zero_grad()
            backward(model, s, step)
            s.unscale_(opt)
            s.step(opt)
            s.update()

    def test_scale_nested_outputs(self, name: str) -> None:
        _, _, s = setup(name)
        a, b = torch.ones(2), torch.full((3,), 2.0)
        out = s.scale([a, (b,)])
        assert isinstance(out, list) and isinstance(out[1], tuple)
        S = s.get_scale()
        assert torch.equal(out[0], a * S) and torch.equal(out[1][0], b * S)
        with pytest.raises(ValueError):
            s.scale([1.0])

    def test_closure_kwarg_rejected(self, name: str) -> None:
        model, opt, s = setup(name)
        backward(model, s, 0)
        with pytest.raises(RuntimeError, match="Closure"):
            s.step(opt, closure=lambda: 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_disabled_is_a_transparent_noop(name: str) -> None:
    model, opt, s = setup(name, enabled=False)
    ref_model, ref_opt = mlp(seed=1), None
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    loss = torch.ones((), requires_grad=True)
    assert s.scale(loss) is loss
    for step in range(4):
        for m, o, strat in ((model, opt, s), (ref_model, ref_opt, None)):
            o.zero_grad()
            x, y = batch(step)
            l = torch.nn.functional.mse_loss(m(x), y)
            if strat is None:
                l.backward()
                o.step()
            else:
                strat.scale(l).backward()
                strat.unscale_(o)
                strat.step(o)
                strat.update()
    assert params_equal(model, ref_model)
    assert optimizer_state_equal(opt, ref_opt)
    assert s.get_scale() == 1.0 and not s.is_enabled()
    assert s.state_dict() == {} and s.telemetry() == {}
    s.load_state_dict({"scale": 5.0})  # no-op when disabled
    assert s.get_scale() == 1.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("when", ["before_init", "after_init"])
def test_state_dict_round_trip(name: str, when: str) -> None:
    """Save mid-run (through torch.save / weights_only load), restore into a fresh instance,
    continue both: identical scales and parameters."""
    kw = dict(init_scale=2.0**10, growth_interval=2)
    model, opt, s = setup(name, **kw)
    for step in range(6):
        one_step(model, opt, s, step, poison="inf" if step == 3 else None)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    model2, opt2, s2 = setup(name, **kw)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may alias tensors
    if when == "after_init":
        s2.scale(torch.ones(()))
    s2.load_state_dict(sd)
    assert s2.get_scale() == s.get_scale()
    assert s2.state_dict() == s.state_dict()
    for step in range(6, 12):
        one_step(model, opt, s, step, poison="nan" if step == 8 else None)
        one_step(model2, opt2, s2, step, poison="nan" if step == 8 else None)
        assert s2.get_scale() == s.get_scale()
    assert params_equal(model, model2)
    assert s2.state_dict() == s.state_dict()


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_rejects_other_strategy_and_garbage(name: str) -> None:
    _, _, s = setup(name)
    with pytest.raises(ValueError, match="strategy"):
        s.load_state_dict({"strategy": "some_other_rule", "scale": 1.0})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"strategy": name, "scale": 1.0})
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})


@pytest.mark.parametrize("name", NAMES)
def test_scale_unscale_update_never_sync(name: str) -> None:
    model, opt, s = setup(name)
    for step in range(5):
        opt.zero_grad()
        with forbid_host_sync():
            backward(model, s, step, poison="nan" if step == 2 else None)
            s.unscale_(opt)
        s.step(opt)  # GradScaler's one allowed sync: the skip decision
        with forbid_host_sync():
            s.update()
            t = s.telemetry()
    assert all(isinstance(v, torch.Tensor) for v in t.values())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(name: str, poison: str) -> None:
    model, opt, s = setup(name)
    for step in range(3):
        one_step(model, opt, s, step)
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()}
             for k, v in opt.state_dict()["state"].items()}
    before = s.get_scale()
    one_step(model, opt, s, 3, poison=poison)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after_state = opt.state_dict()["state"]
    for k in state:
        for n in state[k]:
            x, y = state[k][n], after_state[k][n]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert_backed_off(name, s.get_scale(), before)  # every dynamic rule backs off on non-finite gradients
    tel = s.telemetry()
    assert tel["found_inf"].item() == 1.0 and tel["skipped_steps"].item() == 1


@pytest.mark.parametrize("name", NAMES)
def test_multiple_optimizers_share_one_scale(name: str) -> None:
    """As GradScaler: one scale for all; each optimizer skips on its own gradients' overflow, and
    the overflow of one optimizer's gradients backs the shared scale off."""
    model = mlp(seed=2)
    params = list(model.parameters())
    o1, o2 = torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)
    s = strategies.create(name)
    o1.zero_grad(), o2.zero_grad()
    backward(model, s, 0, poison="inf")  # poisons the last parameter: owned by o2
    before = [p.detach().clone() for p in params]
    S = s.get_scale()
    s.step(o1)
    s.step(o2)
    s.update()
    assert not all(torch.equal(p, q) for p, q in zip(params[:2], before[:2]))  # o1 stepped
    assert all(torch.equal(p, q) for p, q in zip(params[2:], before[2:]))  # o2 skipped
    assert_backed_off(name, s.get_scale(), S)


@pytest.mark.parametrize("name", NAMES)
def test_scale_stays_within_bounds(name: str) -> None:
    lo, hi = 2.0**4, 2.0**12
    model, opt, s = setup(name, init_scale=2.0**8, growth_interval=1, min_scale=lo, max_scale=hi)
    seen = []
    for step in range(40):
        one_step(model, opt, s, step, poison="inf" if step < 20 else None)
        seen.append(s.get_scale())
    assert all(lo <= x <= hi and math.isfinite(x) for x in seen)
    if name in FIXED_SCALE:
        assert seen == [2.0**8] * 40  # in bounds from the start, never moved
    else:
        assert min(seen) == lo  # twenty overflows in a row do reach the floor


@pytest.mark.parametrize("name", NAMES)
def test_telemetry_describes_the_last_update(name: str) -> None:
    model, opt, s = setup(name)
    assert s.telemetry() == {}
    one_step(model, opt, s, 0)
    t = s.telemetry()
    for key in ("scale", "growth_tracker", "found_inf", "skipped_steps", "grad_absmax",
                "grad_norm", "grad_zero_frac", "grad_subnormal_frac"):
        assert isinstance(t[key], torch.Tensor), key
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    # The statistics are those of the unscaled gradients the optimizer saw.
    assert t["grad_absmax"].item() == pytest.approx(grads.abs().max().item(), rel=1e-6)
    assert t["grad_norm"].item() == pytest.approx(grads.norm().item(), rel=1e-5)
    assert t["found_inf"].item() == 0.0 and t["skipped_steps"].item() == 0
    assert t["scale"].item() == s.get_scale()


BAD = [
    ("growth_factor", 1.0), ("growth_factor", 0.5), ("growth_factor", float("nan")),
    ("backoff_factor", 1.0), ("backoff_factor", 0.0), ("backoff_factor", 1.5),
    ("growth_interval", 0), ("growth_interval", 2.5),
    ("init_scale", 0.0), ("init_scale", -1.0), ("init_scale", float("inf")), ("init_scale", float("nan")),
    ("min_scale", -1.0), ("max_scale", 0.0),
    ("distributed", "sometimes"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field,value", BAD)
def test_invalid_hyperparameter_names_field_value_and_range(name: str, field: str, value) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create(name, **{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{field} must be ") and repr(value) in msg
    assert "\n" not in msg


@pytest.mark.parametrize("name", NAMES)
def test_min_scale_above_max_scale_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=r"min_scale must be <= max_scale"):
        strategies.create(name, min_scale=8.0, max_scale=4.0)


def train_a_few_steps(s, model, opt) -> None:
    """Four steps, the third poisoned: what every rule must survive with statistics on or off."""
    for step in range(4):
        one_step(model, opt, s, step, poison="inf" if step == 2 else None)
    tel = s.telemetry()
    assert tel["skipped_steps"].item() == 1 and math.isfinite(s.get_scale()) and s.get_scale() > 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("track_stats", [True, False])
def test_trains_with_statistics_tracking_on_and_off(name: str, track_stats: bool) -> None:
    """With ``track_stats=False`` a rule gets statistics only if it declares ``needs_stats``."""
    model, opt, s = setup(name, track_stats=track_stats)
    s.attach(model)
    train_a_few_steps(s, model, opt)


def test_a_rule_that_reads_statistics_without_declaring_it_fails_the_contract() -> None:
    """The contract run with ``track_stats=False`` catches an undeclared ``needs_stats``."""
    undeclared = type("Undeclared", (strategies.get("max_ema"),), {"needs_stats": False})
    model, opt, _ = setup("native")
    train_a_few_steps(undeclared(track_stats=True), model, opt)  # statistics gathered anyway: passes
    with pytest.raises((AssertionError, AttributeError, TypeError)):
        train_a_few_steps(undeclared(track_stats=False), model, opt)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("when", ["before_init", "after_init"])
@pytest.mark.parametrize("key,value,message", [
    ("scale", math.nan, "'scale' must be finite"),
    ("scale", math.inf, "'scale' must be finite"),
    ("scale", 0.0, "'scale' must be > 0"),
    ("scale", -5.0, "'scale' must be > 0"),
    ("scale", "big", "'scale' must be a number"),
    ("scale", 2.0**20, r"'scale' must be within \[min_scale=1.0, max_scale=65536.0\]"),
    ("_growth_tracker", -1, "'growth_tracker' must be >= 0"),
    ("_growth_tracker", 2.5, "'growth_tracker' must be an integer"),
    ("growth_factor", 0.5, "growth_factor must be > 1"),
    ("growth_interval", 0, "growth_interval must be an integer >= 1"),
    ("skipped_steps", -3, "'skipped_steps' must be >= 0"),
    ("updates", -1, "'updates' must be a non-negative integer"),
    ("extra", [1, 2], "'extra' must be a dict"),
])
def test_load_state_dict_validates_everything_before_changing_anything(
        name: str, when: str, key: str, value, message: str) -> None:
    """A bad entry raises one ValueError naming it; the strategy is exactly as it was (the good
    entries of the same dict — here growth_factor 3 and growth_interval 7 — are not applied)."""
    model, opt, s = setup(name, init_scale=2.0**10, growth_interval=2, min_scale=1.0, max_scale=2.0**16)
    s.attach(model)
    if when == "after_init":
        for step in range(3):
            one_step(model, opt, s, step)
    before = s.state_dict()
    bad = copy.deepcopy(before)
    bad.update(growth_factor=3.0, growth_interval=7)
    bad[key] = value
    if s.per_group and key in ("scale", "_growth_tracker"):  # per-group vectors are checked too
        bad["extra"][key.lstrip("_")] = [value] * s.num_groups
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(bad)
    assert s.state_dict() == before
    assert s.get_growth_factor() == before["growth_factor"] and s.get_growth_interval() == 2


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bounds,shown", [(dict(min_scale=2.0**9), "min_scale=512.0, max_scale=None"),
                                          (dict(min_scale=None, max_scale=2.0**7), "min_scale=None, max_scale=128.0"),
                                          (dict(min_scale=2.0**2, max_scale=2.0**7), "min_scale=4.0, max_scale=128.0")])
def test_init_scale_outside_the_bounds_is_refused_at_construction(name: str, bounds: dict, shown: str) -> None:
    """The first step must not run at a scale outside [min_scale, max_scale] (the clamp only
    comes with the first update): refused, one line naming init_scale and the range."""
    with pytest.raises(ValueError) as e:
        strategies.create(name, init_scale=2.0**8, **bounds)
    assert str(e.value) == f"init_scale must be within [{shown}], got 256.0"


@pytest.mark.parametrize("name", NAMES)
def test_init_scale_on_a_bound_is_the_first_steps_scale(name: str) -> None:
    for lo, hi in ((2.0**8, None), (None, 2.0**8), (2.0**8, 2.0**8)):
        model, opt, s = setup(name, init_scale=2.0**8, min_scale=lo, max_scale=hi)
        s.attach(model)
        x, y = batch(0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        assert torch.equal(s.scale(loss), loss * 2.0**8)  # the first step's scale, before any update


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_scale_set_by_hand_stays_within_the_bounds(name: str, as_tensor: bool) -> None:
    """``update(new_scale)`` (GradScaler's manual override) is an update: S stays within
    [min_scale, max_scale] like after every other one; inside them it is taken as given."""
    lo, hi = 2.0**4, 2.0**12
    model, opt, s = setup(name, init_scale=2.0**8, min_scale=lo, max_scale=hi)
    s.attach(model)
    one_step(model, opt, s, 0)
    for wanted, expected in ((2.0**20, hi), (2.0**-3, lo), (2.0**6, 2.0**6)):
        s.update(torch.tensor(wanted) if as_tensor else wanted)
        assert s.get_scale() == expected
        assert all(lo <= x <= hi for x in s.state.scale.reshape(-1).tolist())
