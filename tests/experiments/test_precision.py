"""Precision modes: fp8 quantise–dequantise against torch's casts, the boundary hooks' gradient
simulation against a hand-chained autograd reference, and the per-layer measurements against
gradients captured independently."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.workloads.models import MLP
from experiments.workloads.precision import HIST_BINS, HIST_LO, BoundaryHooks, Precision, quantize_dequantize
from strategies.formats import FP16_MIN_NORMAL

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _precision(name: str, autocast: torch.dtype | None, fmt: torch.dtype | None) -> Precision:
    info = torch.finfo(fmt or autocast or torch.float32)
    return Precision(name, autocast, fmt, float(info.max), float(info.smallest_normal))


def test_e5m2_rounds_as_torch_and_overflows_to_inf() -> None:
    g = torch.tensor([1.0, 3.3, -5e-3, 1e-6, 2.0**-17, 57344.0, 62000.0, -70000.0, float("inf")])
    q = quantize_dequantize(g, E5M2)
    finite = torch.tensor([True] * 6 + [False] * 3)
    assert torch.equal(q[finite], g[finite].to(E5M2).float())
    assert q[6] == math.inf and q[7] == -math.inf and q[8] == math.inf  # overflow -> inf, like the format
    assert q[4] == 0  # 2^-17 is half the smallest subnormal (2^-16): rounds to even, zero


def test_e4m3_saturates_finite_values_but_keeps_non_finite() -> None:
    g = torch.tensor([1.0, 300.0, 449.0, 1000.0, -1e6, 2.0**-10, float("inf"), float("-inf"), float("nan")])
    q = quantize_dequantize(g, E4M3)
    assert q[:3].tolist() == [1.0, 288.0, 448.0]  # e4m3 has 3 mantissa bits: 300 -> 288
    assert q[3] == 448.0 and q[4] == -448.0  # saturating cast (torch's behaviour)
    assert q[5] == 0.0  # 2^-10 is below half the smallest subnormal 2^-9
    assert q[6] == math.inf and q[7] == -math.inf and torch.isnan(q[8])  # overflow stays visible


def test_fp8_hooks_quantise_every_boundary_gradient() -> None:
    """Parameter gradients with the hooks equal a hand-chained reference that casts the gradient
    at each boundary with torch's own cast."""
    torch.manual_seed(0)
    model = MLP(in_features=6, num_classes=5, width=8, depth=1)
    x = torch.randn(4, 6)
    w = torch.randn(4, 5) * 1000.0  # large upstream gradient: e4m3 saturates at the head boundary
    hooks = BoundaryHooks(model, _precision("fp8_e4m3", None, E4M3))
    (model(x) * w).sum().backward()
    got = model.layers[0][0].weight.grad.clone()
    hooks.remove()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(E4M3).float()

    h = model.layers[0](x)
    out = model.head(h)
    g_h = torch.autograd.grad(out, h, cast(w), retain_graph=True)[0]
    (ref,) = torch.autograd.grad(h, model.layers[0][0].weight, cast(g_h))
    assert cast(w).abs().max() == 448.0
    assert torch.equal(got, ref)
    # And without the fp8 format the hooks change nothing.
    model.zero_grad()
    hooks = BoundaryHooks(model, _precision("fp32", None, None))
    hooks.measure = True
    (model(x) * w).sum().backward()
    (plain,) = torch.autograd.grad((model(x) * w).sum(), model.layers[0][0].weight)
    assert torch.equal(model.layers[0][0].weight.grad, plain)


def test_measurements_match_independently_captured_gradients() -> None:
    torch.manual_seed(1)
    model = MLP(in_features=16, num_classes=10, width=32, depth=2)
    precision = _precision("fp16", torch.float16, None)
    hooks = BoundaryHooks(model, precision)
    captured: dict[str, torch.Tensor] = {}
    for name in model.boundaries:
        def grab(mod, inp, out, name=name):
            out.register_hook(lambda g: captured.__setitem__(name, g.detach().clone()))
        model.get_submodule(name).register_forward_hook(grab)
    x, y = torch.randn(64, 16), torch.randint(10, (64,))
    hooks.measure, hooks.hist = True, True
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    (torch.nn.functional.cross_entropy(logits.float(), y) * 1e-5).backward()  # small: some underflow
    got = hooks.read()
    assert set(got["act_zero_frac"]) == set(model.boundaries)
    total_nonzero, total_zero = 0, 0
    ref_hist = torch.zeros(HIST_BINS, dtype=torch.int64)
    for name, g in captured.items():
        assert g.dtype == torch.float16  # real fp16 activation gradients under CPU autocast
        zero = (g == 0).double().mean().item()
        sub = ((g != 0) & (g.abs().float() < FP16_MIN_NORMAL)).double().mean().item()
        assert got["act_zero_frac"][name] == pytest.approx(zero)
        assert got["act_subnormal_frac"][name] == pytest.approx(sub)
        nz = g[g != 0].float()
        ref_hist += torch.bincount((torch.floor(torch.log2(nz.abs())).long() - HIST_LO).clamp(0, HIST_BINS - 1), minlength=HIST_BINS)
        total_nonzero += nz.numel()
        total_zero += int((g == 0).sum())
    assert any(v > 0 for v in got["act_subnormal_frac"].values())
    assert got["act_exp_hist"]["lo"] == HIST_LO and got["act_exp_hist"]["zeros"] == total_zero
    assert got["act_exp_hist"]["counts"] == ref_hist.tolist() and sum(ref_hist.tolist()) == total_nonzero


def test_hooks_measure_only_when_asked() -> None:
    model = MLP(in_features=4, num_classes=3, width=8, depth=1)
    hooks = BoundaryHooks(model, _precision("fp32", None, None))
    model(torch.randn(2, 4)).sum().backward()
    assert hooks.read() == {"act_zero_frac": {}, "act_subnormal_frac": {}}
    with hooks.disabled():
        hooks.measure = True
        model(torch.randn(2, 4)).sum().backward()
    assert hooks.read()["act_zero_frac"] == {}


def test_precision_config_validation() -> None:
    with pytest.raises(ValueError, match=r"precision.name must be one of fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, fp8_hybrid, mxfp8, fp8_blockwise, nvfp4, got 'fp4'"):
        Precision.from_config({"name": "fp4", "autocast": None, "max": 1.0, "smallest_normal": 0.5})
    with pytest.raises(ValueError, match=r"precision.grad_format must be float8_e4m3fn, float8_e5m2 or null"):
        Precision.from_config({"name": "fp16", "autocast": "float16", "grad_format": "float16", "max": 2.0, "smallest_normal": 1.0})
