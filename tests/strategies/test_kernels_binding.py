"""Binding a rule's update op by name (strategies.binding, Strategy.run_update): the bound list
is, value for value, the positional list the rules wrote by hand before (re-stated here as the
reference); it follows replaced params and state; a missing, ambiguous or unknown name is a
one-line TypeError naming the op and the argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from strategies import base, binding, kernels
from strategies.rules.hybrid import HybridStrategy, hybrid_update_
from strategies.rules.layerwise import LayerwiseStrategy
from strategies.rules.max_ema import MaxEmaStrategy, max_ema_update_
from strategies.params import ScalerParams, hp
from strategies import validation as v
from strategies.stats import GradStats
from strategies.rules.tolerance import ToleranceStrategy


def _recorded(monkeypatch: pytest.MonkeyPatch, s: base.Strategy, found: torch.Tensor,
              stats: GradStats | None) -> dict[str, tuple[Any, ...]]:
    """Run ``s.update_`` with dispatch recording its (op, arguments) instead of running anything."""
    calls: dict[str, tuple[Any, ...]] = {}
    monkeypatch.setattr(kernels, "dispatch", lambda op, twin, *args: calls.__setitem__(op, args))
    s.update_(found, stats)
    return calls


def _stats(G: int) -> GradStats:
    st = GradStats.empty(G, "cpu")
    st.absmax.copy_(torch.arange(1.0, G + 1.0))
    st.numel.fill_(10)
    st.zeros.fill_(3)
    return st


def _same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and (a is b or torch.equal(a, b)), (i, a, b)
        else:
            assert type(a) is type(b) and a == b, (i, a, b)


def test_max_ema_binds_the_list_it_wrote_by_hand(monkeypatch):
    s = MaxEmaStrategy(init_scale=1024.0, growth_factor=3.0, zero_grads="keep", cap_ema_on_overflow=True)
    s.scale(torch.ones(()))
    found, st, p = torch.tensor(0.0), _stats(1), s.params
    got = _recorded(monkeypatch, s, found, st)["max_ema_update_"]
    t = s.state
    _same(got, (t.scale, t.ema, t.ema_steps, t.growth_tracker, t.candidate, found, st.absmax.view(()),
                p.target_max, p.ema_decay, p.growth_factor, p.backoff_factor, p.growth_interval, p.round_pow2,
                False, True))
    assert got[0] is t.scale and got[5] is found  # the tensors themselves, updated in place by the op


def test_layerwise_binds_the_list_it_wrote_by_hand(monkeypatch):
    s = LayerwiseStrategy(min_scale=3.0, max_scale=1e6)
    s.scale(torch.ones(()))
    found, st, p = torch.tensor(1.0), _stats(1), s.params
    got = _recorded(monkeypatch, s, found, st)["layerwise_update_"]
    t = s.state
    _same(got, (t.scale, t.growth_tracker, t.ema, t.ema_steps, t.hysteresis, t.candidate, t.overflow_origin,
                found, st.found_inf, st.absmax, st.numel, t.emitted, t.contaminated, p.rule, p.target_max,
                p.ema_decay, p.growth_factor, p.backoff_factor, p.growth_interval, True, 4.0, 2.0 ** 19,
                p.cap_ema_on_overflow))


def test_hybrid_binds_the_list_it_wrote_by_hand(monkeypatch):
    s = HybridStrategy(zero_jump=0.25)
    s.scale(torch.ones(()))
    found, st, p = torch.tensor(0.0), _stats(2), s.params
    got = _recorded(monkeypatch, s, found, st)["hybrid_update_"]
    t = s.state
    zero = torch.zeros(())
    _same(got, (t.scale, t.ema, t.ema_steps, t.growth_tracker, t.candidate, t.log_ratio_ema, t.ratio_steps,
                t.norm_ratio, t.calibrations, t.zero_frac_prev, t.zero_jumped, found, st.absmax,
                st.fraction(st.zeros), zero, zero, False, True, p.target_max, p.ema_decay, p.growth_factor,
                p.backoff_factor, p.growth_interval, p.round_pow2, True, p.cap_ema_on_overflow, 0.25,
                p.threshold_high, p.threshold_low, p.ratio_ema_decay))
    assert len(got) == len(list(binding.twin_names(hybrid_update_)))


def test_a_state_absent_for_these_params_binds_none(monkeypatch):
    """tolerance's ``fault`` exists only with on_min_scale='raise': None otherwise, the tensor then."""
    plain = ToleranceStrategy()
    plain.scale(torch.ones(()))
    assert _recorded(monkeypatch, plain, torch.tensor(0.0), None)["tolerance_update_"][10] is None
    raising = ToleranceStrategy(min_scale=1.0, on_min_scale="raise")
    raising.scale(torch.ones(()))
    args = _recorded(monkeypatch, raising, torch.tensor(0.0), None)["tolerance_update_"]
    assert args[10] is raising.state.fault and args[11] == 1.0 and args[12] == 1


def test_the_bound_list_follows_replaced_params_and_state(monkeypatch):
    """The list is cached per strategy while state and params are the same objects; replacing
    either (load_state_dict, regroup_) rebinds."""
    s = MaxEmaStrategy(growth_factor=2.0)
    s.scale(torch.ones(()))
    st = _stats(1)
    first = _recorded(monkeypatch, s, torch.tensor(0.0), st)["max_ema_update_"]
    s.params = s.params.replace(growth_factor=4.0)
    assert _recorded(monkeypatch, s, torch.tensor(0.0), st)["max_ema_update_"][9] == 4.0
    old = s.state.scale
    s._lazy_init(torch.device("cpu"))
    again = _recorded(monkeypatch, s, torch.tensor(1.0), st)["max_ema_update_"]
    assert again[0] is s.state.scale and again[0] is not old and first[0] is old
    assert again[5].item() == 1.0  # the per-call input is never cached


@dataclass
class _P(ScalerParams):
    ema: float = hp(0.5, v.finite_positive)


def _twin(scale: torch.Tensor, ema: torch.Tensor, found_inf: torch.Tensor, extra: float) -> None:
    pass


@pytest.mark.parametrize("state,inputs,message", [
    (["scale", "ema"], ("found_inf", "extra"), "argument 'ema' is both a state tensor and a params field of _P"),
    (["scale"], ("found_inf",), "argument 'extra' is neither a state tensor, a field of _P nor a passed input"),
    (["scale", "ema"], ("ema", "extra"), "argument 'found_inf' is neither"),
    (["scale"], ("ema", "found_inf", "extra", "typo"), "input 'typo' is not an argument of _twin"),
])
def test_a_name_found_nowhere_twice_or_unknown_is_a_clear_error(state, inputs, message):
    with pytest.raises(TypeError, match=r"^scalelab::my_op_: " + message.replace("(", r"\(")):
        binding.bind_plan("my_op_", _twin, [*state, "found_inf"], [], _P(), inputs)


def test_found_inf_is_always_the_passed_flag_never_the_state():
    """The base state ``found_inf`` (last step's record) is never bound: forgetting to pass the
    step's flag is an error, not a silent read of the wrong tensor."""
    plan = binding.bind_plan("max_ema_update_", max_ema_update_,
                             ["scale", "ema", "ema_steps", "growth_tracker", "candidate", "found_inf"], [],
                             MaxEmaStrategy().params, ("found_inf", "grad_absmax", "grow_on_zero"))
    assert plan[5] == (binding.INPUT, "found_inf")
    with pytest.raises(TypeError, match="argument 'found_inf' is neither"):
        binding.bind_plan("max_ema_update_", max_ema_update_,
                          ["scale", "ema", "ema_steps", "growth_tracker", "candidate", "found_inf"], [],
                          MaxEmaStrategy().params, ("grad_absmax", "grow_on_zero"))


def test_the_binding_is_built_once_per_state_and_params(monkeypatch):
    """Steps reuse the bound list (no signature walk per step); a replaced state rebinds once."""
    built: list[str] = []
    plan = binding.bind_plan
    monkeypatch.setattr(binding, "bind_plan", lambda op, *a: built.append(op) or plan(op, *a))
    s = MaxEmaStrategy()
    s.scale(torch.ones(()))
    st = _stats(1)
    for _ in range(3):
        _recorded(monkeypatch, s, torch.tensor(0.0), st)
    assert built == ["max_ema_update_"]
    s._lazy_init(torch.device("cpu"))
    _recorded(monkeypatch, s, torch.tensor(0.0), st)
    assert built == ["max_ema_update_"] * 2
