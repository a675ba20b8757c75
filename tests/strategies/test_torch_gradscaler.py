"""PyTorch's own GradScaler training tests, re-written for every strategy (presets included), on
the CPU. Sources: ``test/test_torch.py`` (``TestTorchDeviceType``: ``_run_scaling_case``,
``test_grad_scaling_autocast``, ``_clipping``, ``_clipping_separate_unscale``, ``_penalty``,
``_accumulation``, ``_multiple``) and ``test/test_optim.py``
(``test_grad_scaling_autocast_fused_optimizers``).

Each case trains a control model without scaling next to a model with the strategy, the scaled
one with an Inf gradient injected at ``skip_iter`` (the control skips that step by hand), and
compares gradients, optimizer state and parameters. The expected *scale* after the run is
torch's rule (``128 * growth**unskipped * backoff**skipped``): asserted only for ``native``
(torch's rule, no hysteresis); every other rule must instead have counted exactly the skipped
steps and hold a finite positive scale. The comparisons with the control are rule-independent.
"""

from __future__ import annotations

import math
import pickle
from itertools import chain

import pytest
import torch

import strategies
from tests.helpers import make_strategy, strategy_cases
from tests.strategies.gradscaler_cases import (Data, create_scaling_case, create_scaling_models_optimizers,
                                             presets_slow, torch_rule)

CASES = strategy_cases()


def scaler_for(name: str, kw: dict, model, data: Data, loss_fn, enabled: bool = True, attach: bool = True,
               **overrides):
    """torch's ``GradScaler(init_scale=128., growth_factor=2.0, enabled=enabled, growth_interval=1)``
    ("a modest initial scale and an unrealistically-large growth factor") as the strategy."""
    overrides = {"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1, "enabled": enabled, **overrides}
    return make_strategy(name, kw, model if attach else None,
                         lambda: loss_fn(model(data.current[0]), data.current[1]), **overrides)


def one_scale(name: str) -> bool:
    """Attach only where every gradient carries the one scale ``get_scale()`` returns. torch's
    clipping-without-unscale_ and penalty recipes multiply by that scale; an attached per-group
    rule gives each layer group its own (strategies/rules/layerwise.py), so there it runs unattached
    (one group). Its per-group unscaling is checked by the other cases."""
    return not strategies.get(name).per_group


def picklable(s) -> bool:
    """GradScaler pickles at iteration boundaries. A strategy attached with hooks (the model's
    hooks call this instance) or holding the user's reference closure cannot: a copy would
    silently train against the original's hooks or probe a copied model."""
    return getattr(s, "_closure", None) is None and getattr(s, "_handle", None) is None


def assert_scale_after(scaler, unskipped: int, skipped: int) -> None:
    if not scaler.is_enabled():
        assert scaler.get_scale() == 1.0
    elif torch_rule(scaler):  # torch's exact value: native only
        assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** unskipped \
            * scaler.get_backoff_factor() ** skipped
    else:  # any rule: exactly the injected steps were skipped
        assert scaler.telemetry()["skipped_steps"].item() == skipped
        assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0


def run_scaling_case(name, kw, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD,
                     optimizer_kwargs=None, attach=True):
    """``test/test_torch.py::_run_scaling_case``: enabled and disabled, the strategy's run
    against the control's (same control flow), then gradients, optimizer state and parameters."""
    for enabled in True, False:
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = \
            create_scaling_case(optimizer_ctor, optimizer_kwargs)
        scaler = scaler_for(name, kw, mod_scaling, data, loss_fn, enabled, attach)
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler  # run() may return another instance (pickling)
        assert_scale_after(scaler, unskipped, skipped)
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-05)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-05)


def poison(model) -> None:
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


def scaled_backward(scaler, loss, model, i, skip_iter) -> None:
    """``scaler.scale(loss).backward()``, then torch's Inf into ``model[1].weight.grad`` at ``skip_iter``."""
    scaler.scale(loss).backward()
    if i == skip_iter and scaler.is_enabled():
        poison(model)


def plain_step(optimizer, scaler, i, skip_iter) -> None:
    """The control's step: skipped by hand where the scaled run has its Inf."""
    if (not scaler.is_enabled()) or (i != skip_iter):
        optimizer.step()


def control_step(loss, model, optimizer, scaler, i, skip_iter, max_norm=None) -> None:
    """The control's iteration after its forward: backward, optional clipping, :func:`plain_step`."""
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    plain_step(optimizer, scaler, i, skip_iter)


@pytest.mark.parametrize("name,kw", presets_slow(CASES))
@pytest.mark.parametrize("foreach,fused", [(None, None), (True, None), (None, True)])
@pytest.mark.parametrize("try_pickle", [False, True])
def test_grad_scaling_autocast(name, kw, foreach, fused, try_pickle) -> None:
    """fp32 control vs autocast(float16) + scaling, SGD (torch also runs Adam/AdamW here but
    asserts that they *fail* the comparison; their fused path is covered below)."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.half, enabled=try_scaling_api):
                loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaled_backward(scaler, loss, model, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle and picklable(scaler):
                    scaler = pickle.loads(pickle.dumps(scaler))
                elif try_pickle:  # refused, not a silently detached copy
                    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
                        pickle.dumps(scaler)
            else:
                control_step(loss, model, optimizer, scaler, i, skip_iter)
        return scaler

    # atol=1e-3: pure fp32 arithmetic against a mixture of fp16 and fp32
    run_scaling_case(name, kw, run, unskipped=3, skipped=1, atol=1e-3,
                     optimizer_kwargs={"foreach": foreach, "fused": fused})


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_clipping(name, kw) -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # a value that has an effect (torch's comment)
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():  # torch poisons after this clipping
                    poison(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                control_step(loss, model, optimizer, scaler, i, skip_iter, max_norm)

    run_scaling_case(name, kw, run, unskipped=3, skipped=1, atol=1e-5, attach=one_scale(name))


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_clipping_separate_unscale(name, kw) -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                scaled_backward(scaler, loss, model, i, skip_iter)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                control_step(loss, model, optimizer, scaler, i, skip_iter, max_norm)

    run_scaling_case(name, kw, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_penalty(name, kw) -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaled_backward(scaler, loss, model, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
            else:
                control_step(loss, model, optimizer, scaler, i, skip_iter)

    run_scaling_case(name, kw, run, unskipped=3, skipped=1, attach=one_scale(name))


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_accumulation(name, kw) -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            loss = loss_fn(model(input), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(name, kw, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling_multiple(name, kw) -> None:
    """Two models, two optimizers, both receiving gradients from two losses. The strategy is not
    attached: layerwise's groups must form one chain (strategies/rules/layerwise.py), and two models
    feeding two losses do not; it runs as a single group."""
    for enabled in True, False:
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = create_scaling_case()
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = create_scaling_models_optimizers()
        both = torch.nn.ModuleList([mod_scaling0, mod_scaling1])
        scaler = make_strategy(name, kw, None, lambda: loss_fn(0.3 * both[0](data.current[0])
                                                               + 0.7 * both[1](data.current[0]), data.current[1]),
                               init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0, output1 = model0(input), model1(input)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        poison(model1)
                    scaler.unscale_(optimizer0)  # torch: "separately unscale for one of the optimizers"
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    plain_step(optimizer1, scaler, i, skip_iter)

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        assert_scale_after(scaler, unskipped=3, skipped=1)
        for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                        chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
            torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,kw", presets_slow(CASES))
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("separate_unscale", [False, True])
def test_grad_scaling_autocast_fused_optimizers(name, kw, optimizer_ctor, separate_unscale) -> None:
    """``test/test_optim.py::test_grad_scaling_autocast_fused_optimizers``: a fused optimizer
    (it unscales inside its kernel) against the same non-fused one, each with its own strategy,
    both under autocast(float16): same losses, gradients, parameters and optimizer state."""
    kwargs = {"fused": True} if optimizer_ctor is torch.optim.SGD else {"fused": True, "amsgrad": True}
    mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = create_scaling_case(optimizer_ctor, kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), lr=1.0, **{**kwargs, "fused": False})
    scalers = [scaler_for(name, kw, m, data, loss_fn, growth_interval=2000) for m in (mod_control, mod_scaling)]
    tol = {"atol": 2e-5, "rtol": 2e-5}  # torch's, for float (not Tensor) betas
    for input, target in data:
        losses = []
        for model, opt, scaler, unscale in ((mod_control, opt_control, scalers[0], False),
                                           (mod_scaling, opt_scaling, scalers[1], separate_unscale)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.half):
                losses.append(loss_fn(model(input), target))
            scaler.scale(losses[-1]).backward()
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        torch.testing.assert_close(losses[0], losses[1])
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c, s, **tol)
            for k in opt_control.state[c]:
                torch.testing.assert_close(opt_control.state[c][k], opt_scaling.state[s][k].reshape_as(
                    opt_control.state[c][k]), **tol)
    assert scalers[0].state_dict() == scalers[1].state_dict()
