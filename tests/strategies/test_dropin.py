"""Drop-in wherever GradScaler goes: type and constructor parity, frameworks' private calls, and
fused optimizers handled like GradScaler (they unscale; the strategy only reads the gradients)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import pydoc

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.helpers import UNSCALES_ITSELF, params_equal

NAMES = strategies.available()


def model_and_data(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    return model, torch.randn(16, 4, dtype=dtype), torch.randn(16, 1, dtype=dtype)


@pytest.mark.parametrize("name", NAMES)
def test_is_a_gradscaler_and_takes_the_device_first(name: str) -> None:
    s = strategies.create(name, "cpu", 2.0**10, 3.0, 0.25, 7)
    assert isinstance(s, torch.amp.GradScaler)
    assert (s.params.device, s.params.init_scale, s.get_growth_factor(), s.get_backoff_factor(),
            s.get_growth_interval()) == ("cpu", 2.0**10, 3.0, 0.25, 7)
    assert s._scale is None and s._enabled
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))  # accelerate calls this before loading state
    assert s._scale is not None and s.get_scale() == 2.0**10 and s._growth_tracker is not None
    assert math.isfinite(copy.deepcopy(s).get_scale())


def test_cuda_device_without_cuda_disables_with_gradscalers_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as got:
        torch.amp.GradScaler("cuda")
    with pytest.warns(UserWarning, match=str(got[0].message).replace(".", r"\.")):
        s = strategies.create("native", "cuda")
    assert not s.is_enabled() and s.get_scale() == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_fused_optimizer_unscales_and_the_strategy_only_reads(name: str) -> None:
    """Without unscale_(), a fused AdamW gets grad_scale and found_inf, as from GradScaler: the
    gradients reach optimizer.step still scaled (no second write over them), probes included, except
    for rules that unscale in their own pass (per-group scales)."""
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    s = strategies.create(name, init_scale=2.0**6).attach(model)
    s.set_reference(lambda: F.mse_loss(model(x), y))
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(grad_scale=getattr(o, "grad_scale", None),
                                                          grads=[p.grad.clone() for p in model.parameters()]))
    s.scale(F.mse_loss(model(x), y)).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    s.step(opt)
    s.update()
    if name in UNSCALES_ITSELF:
        assert seen["grad_scale"] is None and not all(torch.equal(a, b) for a, b in zip(seen["grads"], scaled))
    else:
        assert seen["grad_scale"].item() == 2.0**6 and all(torch.equal(a, b) for a, b in zip(seen["grads"], scaled))
    assert s.telemetry()["grad_absmax"].item() == pytest.approx(max(g.abs().max().item() for g in scaled) / 2.0**6)


@pytest.mark.parametrize("poison", [None, "inf"])
def test_native_with_fused_adamw_equals_gradscaler(poison: str | None) -> None:
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
                   strategies.create("native", init_scale=2.0**8, growth_interval=2)):
        model, x, y = model_and_data(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scales = []
        for step in range(6):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y) * (math.inf if poison and step == 3 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((model, scales))
    (a, sa), (b, sb) = runs
    assert sa == sb and params_equal(a, b)


@pytest.mark.parametrize("name", sorted(set(NAMES) - UNSCALES_ITSELF))
def test_fp16_parameters_are_accepted_with_a_fused_optimizer_as_by_gradscaler(name: str) -> None:
    model, x, y = model_and_data(2, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    s = strategies.create(name, init_scale=2.0**4)
    s.scale(F.mse_loss(model(x), y).float()).backward()
    s.step(opt)
    s.update()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):  # unscale_ itself still refuses
        s.scale(F.mse_loss(model(x), y).float()).backward()
        s.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


GRADSCALER_ARGS = list(inspect.signature(torch.amp.GradScaler.__init__).parameters)[1:]


@pytest.mark.parametrize("name", NAMES)
def test_signature_is_gradscalers_then_bounds_then_the_rules_own(name: str) -> None:
    """``inspect.signature`` / ``help()`` / IDEs see the real constructor: GradScaler's six
    parameters in GradScaler's order (positional or keyword), then min_scale, max_scale and every
    other field of the rule's Params (keyword-only), with the rule's defaults."""
    cls = strategies.get(name)
    sig = inspect.signature(cls.__init__)
    names = list(sig.parameters)
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    assert GRADSCALER_ARGS == ["device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"]
    assert names[0] == "self" and names[1:7] == GRADSCALER_ARGS and names[7:9] == ["min_scale", "max_scale"]
    assert set(names[1:]) == set(fields)  # every field, nothing else: no (*args, **kwargs)
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        positional = p.name in GRADSCALER_ARGS
        assert p.kind is (inspect.Parameter.POSITIONAL_OR_KEYWORD if positional else inspect.Parameter.KEYWORD_ONLY)
        assert p.default == fields[p.name].default, p.name
        assert p.annotation is not inspect.Parameter.empty, p.name
    assert "min_scale" in pydoc.render_doc(cls)  # help() shows it
    with pytest.raises(TypeError, match=rf"^{name}: too many positional arguments"):
        cls("cpu", 2.0**10, 2.0, 0.5, 10, True, 1.0)
    with pytest.raises(TypeError, match=rf"^{name}: got an unexpected keyword argument 'init_scael'"):
        cls(init_scael=2.0)


def assert_same_attributes(s, g: torch.amp.GradScaler) -> None:
    """Every instance attribute GradScaler's __init__ sets, with GradScaler's value."""
    assert set(vars(g)) == {"_device", "_enabled", "_init_scale", "_scale", "_growth_factor", "_backoff_factor",
                            "_growth_interval", "_init_growth_tracker", "_growth_tracker", "_per_optimizer_states"}
    for attr, expected in vars(g).items():
        got = getattr(s, attr)
        if isinstance(expected, torch.Tensor):  # a per-group rule's is one entry per group
            assert torch.equal(got.flatten()[-1:], expected.reshape(1)) and got.dtype == expected.dtype, attr
        elif attr == "_per_optimizer_states":
            assert isinstance(got, type(expected)) and len(got) == len(expected) == 0
        else:
            assert got == expected and type(got) is type(expected), attr


@pytest.mark.parametrize("name", NAMES)
def test_gradscalers_instance_attributes_exist_with_gradscalers_values(name: str) -> None:
    """Frameworks read (and some set) GradScaler's private attributes: ``_init_scale``,
    ``_init_growth_tracker``, ``_growth_factor``, ... — before and after the lazy initialisation
    and after ``load_state_dict``, as torch/amp/grad_scaler.py keeps them."""
    args = ("cpu", 2.0**10, 3.0, 0.25, 7)
    s, g = strategies.create(name, *args), torch.amp.GradScaler(*args)
    assert_same_attributes(s, g)
    sd = {"scale": 2.0**8, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 5, "_growth_tracker": 3}
    s.load_state_dict(dict(sd)), g.load_state_dict(dict(sd))
    assert_same_attributes(s, g)
    for scaler in s, g:
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert_same_attributes(s, g)
    assert s._get_growth_tracker() == 3 and s.get_scale() == 2.0**8


@pytest.mark.parametrize("name", NAMES)
def test_gradscalers_attributes_set_as_on_gradscaler(name: str) -> None:
    """``scaler._init_scale = x`` before the first scale() starts there (seen in user code);
    the factors write through the validated parameters."""
    s, g = strategies.create(name, "cpu", 2.0**10), torch.amp.GradScaler("cpu", 2.0**10)
    for scaler in s, g:
        scaler._init_scale, scaler._init_growth_tracker, scaler._growth_factor = 2.0**6, 1, 4.0
        scaler._backoff_factor, scaler._growth_interval = 0.25, 9
        scaler.scale(torch.ones(()))
    assert_same_attributes(s, g)
    assert s.get_scale() == 2.0**6 and s._get_growth_tracker() == 1
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.25, 9)
    with pytest.raises(ValueError, match=r"^growth_factor must be > 1, got 0.5$"):
        s._growth_factor = 0.5
    with pytest.raises(ValueError, match=r"^init_scale must be finite and > 0, got -1.0$"):
        s._init_scale = -1.0
    with pytest.raises(ValueError, match=r"^_init_growth_tracker must be an integer >= 0, got -1$"):
        s._init_growth_tracker = -1
    s._init_scale = 2.0**3  # after the lazy init: recorded only, as GradScaler
    assert s.get_scale() == 2.0**6 and s._init_scale == 2.0**3
