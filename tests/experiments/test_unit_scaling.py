"""experiments/workloads/unit_scaling.py against plain torch: each scaled op's value and gradients are torch's
times the scales the library states; the unit-scaled GPT's gradients are the true gradients of
its forward times one constant per parameter (the scale constraints hold); at init its
activations and activation gradients have std near 1 at every layer, the standard GPT's
gradients do not; under fp16 autocast its activation gradients do not underflow."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from experiments.app import recipe

from experiments.workloads import unit_scaling as us
from experiments.workloads.models import GPT
from experiments.workloads.precision import BoundaryHooks, Precision

V, T, B, C = 65, 16, 8, 32


def _leaf(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _grads(fn, *xs: torch.Tensor, g: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for x in xs:
        x.grad = None
    y = fn(*xs)
    y.backward(torch.ones_like(y) if g is None else g)
    return y.detach(), [x.grad.clone() for x in xs]


def test_scaled_forward_and_backward_scales_independently():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        x = _leaf(5, 7, dtype=dtype)
        g = torch.randn(5, 7, dtype=dtype)
        y, (gx,) = _grads(lambda x: us.scaled(x, 3.0, 0.25), x, g=g)
        assert y.dtype == dtype and gx.dtype == dtype
        assert torch.equal(y, x.detach() * 3.0)
        assert torch.equal(gx, g * 0.25)


@pytest.mark.parametrize("constraint", ["gmean", None])
def test_linear_is_torch_linear_times_its_scales(constraint):
    torch.manual_seed(1)
    fan_in, fan_out = 24, 40
    x, w, b = _leaf(B, T, fan_in), _leaf(fan_out, fan_in), _leaf(fan_out)
    g = torch.randn(B, T, fan_out, dtype=torch.float64)
    y, (gx, gw, gb) = _grads(lambda x, w, b: us.linear(x, w, b, constraint), x, w, b, g=g)
    ref, (rx, rw, rb) = _grads(F.linear, x, w, b, g=g)
    out_s, in_s = fan_in ** -0.5, fan_out ** -0.5
    if constraint == "gmean":
        out_s = in_s = (fan_in * fan_out) ** -0.25
    batch = B * T
    torch.testing.assert_close(y, ref * out_s)
    torch.testing.assert_close(gx, rx * in_s)
    torch.testing.assert_close(gw, rw * batch ** -0.5)
    torch.testing.assert_close(gb, rb * batch ** -0.5)


def test_elementwise_ops_are_torch_times_their_scales():
    torch.manual_seed(2)
    x, g = _leaf(B, T, C), torch.randn(B, T, C, dtype=torch.float64)
    s = math.sqrt(us.GELU_OUT * us.GELU_GRAD)
    y, (gx,) = _grads(us.gelu, x, g=g)
    ref, (rx,) = _grads(F.gelu, x, g=g)
    torch.testing.assert_close(y, ref * s)
    torch.testing.assert_close(gx, rx * s)
    # layer norm: output unchanged, gain/bias gradients times (C / numel)^1/2
    w, b = _leaf(C), _leaf(C)
    y, (gx, gw, gb) = _grads(lambda x, w, b: us.layer_norm(x, w, b, 1e-5), x, w, b, g=g)
    ref, (rx, rw, rb) = _grads(lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5), x, w, b, g=g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw * (B * T) ** -0.5)
    torch.testing.assert_close(gb, rb * (B * T) ** -0.5)


def test_embedding_and_residual_and_attention_scales():
    torch.manual_seed(3)
    idx = torch.randint(0, V, (B, T))
    table, g = _leaf(V, C), torch.randn(B, T, C, dtype=torch.float64)
    y, (gt,) = _grads(lambda w: us.embedding(idx, w), table, g=g)
    ref, (rt,) = _grads(lambda w: F.embedding(idx, w), table, g=g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gt, rt * (V / (B * T)) ** 0.5)
    # residual split/add around f: the forward is tau^1/2 f(x) + (1-tau)^1/2 x and the gradient exact
    x, w = _leaf(B, T, C), _leaf(C, C)
    tau = 0.01

    def block(x, w):
        res, skip = us.residual_split(x, tau)
        return us.residual_add(torch.tanh(res @ w), skip, tau)

    y, (gx, gw) = _grads(block, x, w, g=g)
    ref, (rx, rw) = _grads(lambda x, w: tau ** 0.5 * torch.tanh(x @ w) + (1 - tau) ** 0.5 * x, x, w, g=g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw * tau ** -0.5)  # inside the branch the gradient is not shrunk by tau^1/2
    # attention: output and q, k, v gradients times (T / e)^1/2
    q, k, v = _leaf(B, 4, T, 8), _leaf(B, 4, T, 8), _leaf(B, 4, T, 8)
    g = torch.randn(B, 4, T, 8, dtype=torch.float64)
    s = (T / math.e) ** 0.5
    y, gs = _grads(us.attention, q, k, v, g=g)
    ref, rs = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, g=g)
    torch.testing.assert_close(y, ref * s)
    for got, want in zip(gs, rs):
        torch.testing.assert_close(got, want * s)


def test_cross_entropy_and_the_loops_mean_loss_give_the_library_gradient():
    torch.manual_seed(4)
    n = B * T
    logits, y = _leaf(n, V), torch.randint(0, V, (n,))
    loss, (gl,) = _grads(lambda z: us.cross_entropy(z, y), logits)
    torch.testing.assert_close(loss, F.cross_entropy(logits.detach(), y))
    want = (logits.detach().softmax(-1) - F.one_hot(y, V)) * V / (V - 1) ** 0.5
    torch.testing.assert_close(gl, want)
    # the model's loss_grad_scale + scalelab's mean loss (recipe.loss) = the same gradient
    z = _leaf(B, T, V)
    _, (gz,) = _grads(lambda z: recipe.loss(us.loss_grad_scale(z), y.view(B, T)), z)
    want = (z.detach().softmax(-1) - F.one_hot(y.view(B, T), V)) * V / (V - 1) ** 0.5
    torch.testing.assert_close(gz, want, rtol=1e-5, atol=1e-6)  # loss_grad_scale computes in fp32
    assert gz.std().item() == pytest.approx(1.0, rel=0.1)  # unit at a near-uniform softmax
    # fp16 logits (autocast's head) over many positions: the mean's 1/N gradient (~1/(N V) ~ 4e-6,
    # fp16-subnormal) is undone in fp32, so the fp16 gradient is the unit one rounded once
    z16 = torch.randn(64, 64, V).half().requires_grad_()
    y16 = torch.randint(0, V, (64, 64))
    recipe.loss(us.loss_grad_scale(z16), y16).backward()
    want = (z16.detach().float().softmax(-1) - F.one_hot(y16, V)) * V / (V - 1) ** 0.5
    torch.testing.assert_close(z16.grad.float(), want.half().float(), rtol=2e-3, atol=1e-4)


def test_dropout_scales():
    x = torch.ones(4000, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    y = us.dropout(x, 0.5, True)
    y.backward(torch.ones_like(y))
    kept = y.detach() != 0
    torch.testing.assert_close(y.detach()[kept], torch.full_like(y.detach()[kept], 0.5 ** 0.5 / 0.5))
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 0.5 ** 0.5 / 0.5))
    assert us.dropout(x, 0.5, False) is x


def _gpt(unit: bool, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=V, block_size=T, n_layer=n_layer, n_head=4, n_embd=C, unit_scaled=unit)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def test_unit_gpt_gradients_are_true_gradients_times_one_constant_per_parameter(monkeypatch):
    """The scale constraints: where forward and backward scales differ, only per-tensor constants
    change. Reference: the same forward with every ``scaled`` a plain ``x * fwd_scale``."""
    x, y = _batch()
    model = _gpt(True).double()
    recipe.loss(model(x), y).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(us, "scaled", lambda t, fwd_scale=1.0, bwd_scale=1.0: t * fwd_scale)
    recipe.loss(model(x), y).backward()
    for name, p in model.named_parameters():
        true, g = p.grad.flatten(), got[name].flatten()
        c = torch.dot(g, true) / torch.dot(true, true)
        assert c > 0, name
        # loss_grad_scale computes the loss in fp32: agreement to fp32 rounding (~3e-8 measured)
        assert ((g - c * true).norm() / g.norm()).item() < 1e-6, name


def _stds(model: GPT, autocast: torch.dtype | None = None) -> dict[str, tuple[float, float]]:
    """(activation std, activation-gradient std) of every module that owns parameters."""
    outs: dict[str, torch.Tensor] = {}
    names = [n for n, m in model.named_modules() if n and n != "blocks" and any(True for _ in m.parameters())]

    def hook(name):
        def h(_m, _i, out):
            out.retain_grad()
            outs[name] = out
        return h

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    x, y = _batch()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        logits = model(x)
    recipe.loss(logits, y).backward()
    for h in handles:
        h.remove()
    return {n: (o.float().std().item(), o.grad.float().std().item()) for n, o in outs.items()}


def test_unit_gpt_has_unit_scale_at_every_layer_at_init_and_the_standard_gpt_does_not():
    unit, std = _stds(_gpt(True, n_layer=3)), _stds(_gpt(False, n_layer=3))
    assert len(unit) >= 3 * 6 + 3  # every linear, layer norm, block, embed, head
    for name, (act, grad) in unit.items():
        assert 0.3 < act < 3 and 0.3 < grad < 3, (name, act, grad)
    # the standard GPT: activation gradients far below unit at every layer (the mean loss's 1/N)
    for name, (_act, grad) in std.items():
        assert grad < 0.03, (name, grad)


def _underflow(model: GPT) -> float:
    """The largest fraction, over the layer boundaries below the head, of activation-gradient
    entries that are zero or fp16-subnormal after one fp16 autocast step on the CPU."""
    hooks = BoundaryHooks(model, Precision.from_config({"name": "fp16", "autocast": "float16",
                                                        "max": 65504.0, "smallest_normal": 2.0 ** -14}))
    hooks.measure = True
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    recipe.loss(logits, y).backward()
    read = hooks.read()
    hooks.remove()
    names = [n for n in read["act_subnormal_frac"] if n != "head"]
    return max(read["act_subnormal_frac"][n] + read["act_zero_frac"][n] for n in names)


def test_fp16_activation_gradients_stay_in_range_only_for_the_unit_gpt():
    assert _underflow(_gpt(True)) < 1e-3
    assert _underflow(_gpt(False)) > 0.01


def test_default_is_the_standard_gpt_and_bad_options_are_refused():
    torch.manual_seed(0)
    a = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=C)
    b = _gpt(False)
    assert not a.unit_scaled
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    assert sorted(_gpt(True).state_dict()) == sorted(a.state_dict())  # same parameter names
    assert _gpt(True).boundaries == a.boundaries
    with pytest.raises(ValueError, match="model.unit_scaled must be true or false"):
        GPT(vocab_size=V, block_size=T, unit_scaled=1)
    with pytest.raises(ValueError, match="model.unit_scaled=true supports only"):
        GPT(vocab_size=V, block_size=T, unit_scaled=True, qk_norm=True)
    with pytest.raises(ValueError, match="constraint must be"):
        us.linear(torch.ones(2, 3), torch.ones(4, 3), None, constraint="amean")
