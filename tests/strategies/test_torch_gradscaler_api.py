"""PyTorch's own GradScaler API tests, re-written for every strategy (presets included), on the
CPU. Sources: ``test/test_torch.py`` (``TestTorchDeviceType``: ``test_grad_scaling_unscale``,
``_update_scale``, ``_unscale_sparse``, ``_state_dict``, ``test_pickle_gradscaler``,
``test_grad_scale_will_not_overflow``, ``test_params_invalidated_with_grads_invalidated_between_
unscale_and_step``, ``test_grad_scaler_pass_itself``) and ``test/test_cuda.py``
(``test_grad_scaling_scale``). Assertions about torch's exact scale values are applied to
``native`` only (said per test); the rest hold for every rule.

Already covered elsewhere and not repeated: ``unscale_`` twice / after ``step`` and ``step``
twice (test_contract.py ``TestStateMachine``), the disabled scaler's empty ``state_dict`` and
no-op ``load_state_dict`` (test_contract.py ``test_disabled_is_a_transparent_noop``).
Not re-written: ``test_grad_scaling_multigpu`` and ``test_grad_scaling_device_as_key`` (two CUDA
devices; the latter tests ``torch.device`` hashing), ``test_grad_scaler_deprecated_warning``
(``torch.cuda.amp.GradScaler``'s constructor).
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import strategies
from strategies.base import _fresh_optimizer_state
from tests.helpers import UNSCALES_ITSELF, make_strategy, strategy_cases
from tests.strategies.gradscaler_cases import create_scaling_case, presets_slow, torch_rule

CASES = strategy_cases()


def bare(name: str, kw: dict, **overrides) -> strategies.Strategy:
    """The strategy alone (no model, no reference), GradScaler-style keywords overriding the preset's."""
    return make_strategy(name, kw, None, None, **overrides)


def enabled_or_skip(s: strategies.Strategy) -> None:
    if not s.is_enabled():  # "none"
        pytest.skip("disabled: a transparent no-op, as GradScaler(enabled=False) (test_contract.py)")


@pytest.mark.parametrize("name,kw", CASES)
@pytest.mark.parametrize("dtype", [torch.float, torch.double])
def test_grad_scaling_unscale(name, kw, dtype) -> None:
    """Gradients of 4 at scale 4 unscale to ones: contiguous, transposed (dense, not contiguous)
    and sliced (not dense) gradients, each with an Inf or NaN anywhere found. torch calls
    ``_unscale_grads_`` (kept torch's own by Strategy, checked too, with its fp16 grads); the
    strategy's own path is ``unscale_``, which refuses fp16 gradients as GradScaler's does."""
    g = torch.full((20, 20), 4.0, dtype=dtype)

    def perfect_storm_grads(inject_inf: int, fp16: bool):
        grads = [g.clone(), g.clone()[:, :5], g.clone().t()]
        grads += [g.to(torch.float16), g.to(torch.float16)] if fp16 else []
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf") if inject_inf % 2 else float("nan")
        return grads

    for fp16 in False, True:
        params = [torch.empty_like(x, requires_grad=True) for x in perfect_storm_grads(-1, fp16)]
        opt = torch.optim.SGD(params, lr=1.0)
        for inject_inf in range(-1, len(params)):
            s = bare(name, kw, init_scale=4.0)
            enabled_or_skip(s)
            s.scale(torch.ones(()))  # lazy init at 4
            grads = perfect_storm_grads(inject_inf, fp16)
            for p, grad in zip(params, grads):
                p.grad = grad
            if fp16:
                found = s._unscale_grads_(opt, torch.full((), 0.25), torch.zeros(()), True)
            else:
                s.unscale_(opt)
                found = s._per_optimizer_states[id(opt)]["found_inf_per_device"]
            assert sum(v.item() for v in found.values()) == (inject_inf >= 0)
            if inject_inf < 0:
                for grad in grads:
                    torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_update_scale(name, kw) -> None:
    """torch's schedule (growth 2, backoff 0.25, interval 2 from scale 4: 4, 8, then 2 after an
    Inf) is native's only; every rule honours ``update(new_scale)`` (float or tensor) and counts
    the skipped step."""
    s = bare(name, kw, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    enabled_or_skip(s)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    seen = []
    for grad in 1.0, 1.0, math.inf:
        s.scale(p.sum()).backward()
        p.grad.fill_(grad)
        s.step(opt)
        s.update()
        seen.append((s.get_scale(), s._get_growth_tracker()))
    if torch_rule(s):
        assert seen == [(4.0, 1), (8.0, 0), (2.0, 0)]
    assert s.telemetry()["skipped_steps"].item() == 1
    s.update(8.0)
    assert s.get_scale() == 8.0
    s.update(torch.full((1,), 16.0))
    assert s.get_scale() == 16.0


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_unscale_sparse(name, kw) -> None:
    """Sparse fp32 gradients unscale (values / 4) and an Inf or NaN in their values is found.
    (torch's fp16 half goes through ``_unscale_grads_``, torch's own code: not repeated.)"""
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    for last, found in (64.0, 0.0), (math.inf, 1.0), (math.nan, 1.0):
        s = bare(name, kw, init_scale=4.0)
        enabled_or_skip(s)
        s.scale(torch.ones(()))
        sp = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
        p = sp.clone()
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, last]), (2, 3))
        s.unscale_(opt)
        assert sum(v.item() for v in s._per_optimizer_states[id(opt)]["found_inf_per_device"].values()) == found
        if not found:
            assert torch.equal(p.grad.to_dense(), (sp / 4).to_dense())


@pytest.mark.parametrize("name,kw", CASES)
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(name, kw, lazy_init_scale) -> None:
    s0 = bare(name, kw, init_scale=4.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = bare(name, kw, init_scale=8.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    enabled_or_skip(s0)
    if lazy_init_scale:  # a scale() call lazily initialises the scale tensor
        s1.scale(torch.full((1,), 4.0))
        assert s1._scale.dtype == torch.float32 and s1._scale.device.type == "cpu"
    s1.load_state_dict(s0.state_dict())
    # torch uses init_scale 3 and 6; 4 and 8 here, as the power-of-two rules round scales down
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
            s1._get_growth_tracker()) == (4.0, 4.0, 0.5, 2, 0)


@pytest.mark.parametrize("name,kw", CASES)
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_pickle_gradscaler(name, kw, lazy_init_scale) -> None:
    a = bare(name, kw, init_scale=4.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy_init_scale and a.is_enabled():
        a.scale(torch.tensor([4.0]))
        assert a._scale.device.type == "cpu"
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled()
    if a.is_enabled():
        assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval(),
                b._get_growth_tracker()) == (4.0, 4.0, 0.5, 2, 0)
        assert b._per_optimizer_states["fdsa"] == _fresh_optimizer_state()  # the defaultdict's factory
        if lazy_init_scale:
            assert b.scale(torch.tensor([4.0])).item() == 16.0


@pytest.mark.parametrize("name,how", [("layerwise", "attach"), ("underflow_target", "attach"),
                                      ("norm_ratio", "reference"), ("hybrid", "reference")])
def test_pickling_a_bound_strategy_is_one_clear_error(name, how) -> None:
    """An attached strategy (the model's hooks call it) or one holding a reference closure
    refuses pickle and deepcopy with one line saying why and what to do; detached or without
    the closure it pickles again."""
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    s = strategies.create(name)
    if how == "attach":
        s.attach(model)
        want = rf"{name}: an attached strategy cannot be pickled or copied .* detach\(\) it first"
    else:
        s.set_reference(lambda: model(torch.ones(2, 4)).sum())
        want = rf"{name}: a strategy holding a reference closure cannot be pickled or copied"
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=want):
            copier(s)
    if how == "attach":
        s.detach()
    else:
        s.set_reference(None)
    assert pickle.loads(pickle.dumps(s)).name == name


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scale_will_not_overflow(name, kw) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    # torch uses init_scale 1e38; 2**126 (the power of two just below) here, as layerwise takes only powers of two
    s = make_strategy(name, kw, model, lambda: ((model(x) - y) ** 2).mean(), growth_interval=1,
                      growth_factor=2.0**4, init_scale=2.0**126)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    s.scale(((model(x) - y) ** 2).mean()).backward()
    s.step(optimizer)
    s.update()
    assert math.isfinite(s.get_scale())


@pytest.mark.parametrize("name,kw", presets_slow(CASES))
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("impl", [{}, {"foreach": True}, {"fused": True}], ids=["forloop", "foreach", "fused"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(name, kw, optimizer_ctor, impl) -> None:
    """Gradients broken after ``unscale_`` are not checked again: the step runs on them."""
    model, _, optimizer, _, data, loss_fn, _ = create_scaling_case(optimizer_ctor, impl)
    s = make_strategy(name, kw, model, lambda: loss_fn(model(data.current[0]), data.current[1]), init_scale=128.0)
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.half):
            loss = loss_fn(model(input), target)
        s.scale(loss).backward()
        s.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):  # deliberately break grads
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        s.step(optimizer)
        s.update()
    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


class _PlaceHolderOptimizer(torch.optim.Optimizer):
    def __init__(self, params, defaults=None):
        super().__init__(params, defaults or {})
        self._step_supports_amp_scaling = True


class Optimizer1(_PlaceHolderOptimizer):
    def step(self, closure=None, *, grad_scaler=None):
        assert isinstance(grad_scaler, torch.amp.GradScaler)
        assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
        self.received = grad_scaler


class Optimizer2(_PlaceHolderOptimizer):
    def step(self, closure=None):
        self.got = self.grad_scale, self.found_inf


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaler_pass_itself(name, kw) -> None:
    """An optimizer whose step takes ``grad_scaler`` receives the strategy (with GradScaler's
    FutureWarning); one without gets ``grad_scale`` and ``found_inf`` tensors — ``grad_scale``
    None for the rules that unscale in their own pass first (per-group scales, probes), as from
    GradScaler after ``unscale_``."""
    x = torch.randn(4, 4)
    m = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    s = make_strategy(name, kw, m, lambda: m(x).mean(), init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.half):
        loss = m(x).mean()
    enabled_or_skip(s)  # a disabled one calls step() plainly: grad_scaler=None, as GradScaler's
    s.scale(loss).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        s.step(o1)
    assert o1.received is s
    s.step(o2)
    s.update()
    grad_scale, found_inf = o2.got
    assert isinstance(found_inf, torch.Tensor)
    if name in UNSCALES_ITSELF:
        assert grad_scale is None
    else:
        assert isinstance(grad_scale, torch.Tensor) and grad_scale.item() == 2.0


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_scale(name, kw) -> None:
    """test_cuda.py's nested outputs (its second device is this one here): every leaf scaled,
    the structure kept, the scale tensor on the outputs' device."""
    s = bare(name, kw, init_scale=2.0)
    enabled_or_skip(s)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 4.0)
    outputs = s.scale((t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())]))
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    assert outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0
    assert outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0
    assert s._scale.device == t1.device


def test_native_state_dict_loads_into_gradscaler_and_back() -> None:
    """native's state_dict loads into torch.amp.GradScaler and back (the rule is torch's)."""
    s = strategies.create("native", "cpu", init_scale=4.0, growth_interval=2)
    g = torch.amp.GradScaler("cpu")
    g.load_state_dict(s.state_dict())
    assert g.get_scale() == 4.0 and g.get_growth_interval() == 2
    s2 = strategies.create("native", "cpu")
    s2.load_state_dict(g.state_dict())
    assert s2.get_scale() == 4.0
    assert torch.equal(s2.scale(torch.ones(2)), torch.full((2,), 4.0))
