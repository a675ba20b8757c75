"""``strategies.doctor.diagnose`` against independent references: the fp32 value of the first
overflowing module, torch.amp.GradScaler's next scale, a plain autocast backward's lost entries."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from experiments.workloads.models import GPT, MLP
from strategies.doctor import CAUSES, EXIT_CODES, diagnose


def ce(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def mlp(seed: int = 0, width: int = 32) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    return MLP(in_features=16, num_classes=10, width=width, depth=3), (torch.randn(48, 16), torch.randint(10, (48,)))


def test_forward_overflow_names_the_module_and_its_fp32_value() -> None:
    model, batch = mlp()
    with torch.no_grad():
        model.layers[1][0].weight.mul_(1e6)
    d = diagnose(model, ce, batch, compare_strategies=False)
    assert d.cause == "forward_overflow" and d.first_module == "layers.1.0"
    with torch.no_grad():  # the reference: that Linear's fp32 output on the fp32 input it receives
        h = model.layers[0](batch[0])
        expected = model.layers[1][0](h).abs().max().item()
    assert expected > 65504
    # Its input came from an fp16 forward, so the recomputed value agrees to fp16 input rounding.
    assert d.value == pytest.approx(expected, rel=1e-2)
    assert "fp32" in d.fix and "bf16" in d.fix and d.exit_code == EXIT_CODES["forward_overflow"] == 3


def test_bf16_is_the_control_where_fp16_overflows_forward() -> None:
    model, batch = mlp()
    with torch.no_grad():
        model.layers[1][0].weight.mul_(1e6)
    assert diagnose(model, ce, batch, precision="bf16", compare_strategies=False).cause != "forward_overflow"


def test_the_step_leaves_weights_grads_and_rng_untouched() -> None:
    model, batch = mlp()
    ce(model, batch).backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    diagnose(model, ce, batch)
    assert torch.equal(rng, torch.get_rng_state())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n


def test_overflow_at_the_scale_only_is_told_from_overflow_at_scale_one() -> None:
    model, batch = mlp()
    probing = diagnose(model, lambda m, b: ce(m, b) * 100.0, batch, compare_strategies=False)
    genuine = diagnose(model, lambda m, b: F.cross_entropy(m(b[0]).float(), b[1], reduction="sum") * 1e5,
                       batch, compare_strategies=False)
    assert probing.cause == "scale_overflow" and probing.exit_code == 1
    assert genuine.cause == "gradient_overflow" and genuine.exit_code == 7
    assert probing.first_module == genuine.first_module == "head"
    # The value is the head's fp32 parameter-gradient abs-max times the scale (beyond fp16's range).
    model.zero_grad()
    (ce(model, batch) * 100.0).backward()
    peak = max(p.grad.abs().max().item() for p in model.head.parameters())
    assert probing.value == pytest.approx(peak * 2.0**16, rel=1e-5) and probing.value > 65504
    assert probing.passes == {"forward": 2, "backward": 3}  # fp32, mixed at S, mixed at 1


def test_native_strategy_chooses_torch_gradscalers_next_scale() -> None:
    model, batch = mlp()
    loss_fn = lambda m, b: ce(m, b) * 100.0  # noqa: E731 - overflows at 2^16, not at 2^15
    d = diagnose(model, loss_fn, batch, strategy_names=["native", "static"])
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, batch)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert d.strategy_scales["native"] == scaler.get_scale() == 2.0**15
    assert d.strategy_scales["static"] == 1024.0
    assert {2.0**16, 2.0**15, 1024.0} <= {x.scale for x in d.per_layer}


def test_lost_fraction_matches_a_plain_autocast_backward() -> None:
    model, batch = mlp()
    loss_fn = lambda m, b: ce(m, b) * 1e-7  # noqa: E731 - small gradients: fp16 flushes some to zero
    S = 2.0**10
    d = diagnose(model, loss_fn, batch, scale=S, compare_strategies=False)
    ref = torch.autograd.grad(loss_fn(model, batch), list(model.head.parameters()))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, batch)
    low = torch.autograd.grad(loss * S, list(model.head.parameters()))
    nz = sum(int((r != 0).sum()) for r in ref)
    lost = sum(int(((r != 0) & (g == 0)).sum()) for g, r in zip(low, ref))
    head = next(x for x in d.per_layer if x.layer == "head" and x.scale == S)
    assert lost > 0 and head.lost_frac == pytest.approx(lost / nz)
    g, r = torch.cat([t.flatten() / S for t in low]).double(), torch.cat([t.flatten() for t in ref]).double()
    assert head.cosine == pytest.approx(float(g @ r / (g.norm() * r.norm())), rel=1e-9)
    assert d.cause == "underflow"


def test_nan_batch_and_nan_loss() -> None:
    model, (x, y) = mlp()
    x = x.clone()
    x[3, 2] = float("nan")
    d = diagnose(model, ce, (x, y))
    assert d.cause == "nan_in_data_or_loss" and "1 NaN/Inf" in d.evidence[0] and d.exit_code == 4
    d = diagnose(model, lambda m, b: ce(m, b) + torch.log(torch.zeros(())), (x.nan_to_num(), y))
    assert d.cause == "nan_in_data_or_loss"


def test_grads_not_cleared_needs_accumulated_grads() -> None:
    model, batch = mlp()
    ce(model, batch).backward()
    assert diagnose(model, ce, batch, compare_strategies=False).cause == "healthy"  # one step's grads: fine
    for _ in range(3):
        ce(model, batch).backward()
    d = diagnose(model, ce, batch, compare_strategies=False)
    assert d.cause == "grads_not_cleared" and "4.0x" in d.evidence[0]


def test_lr_spike_needs_an_overflow_and_a_jump_not_a_warmup() -> None:
    model, batch = mlp()
    big = lambda m, b: ce(m, b) * 100.0  # noqa: E731
    assert diagnose(model, big, batch, lr_history=[1e-3] * 5 + [1e-1], compare_strategies=False).cause == "lr_spike"
    warmup = [i * 1e-4 for i in range(1, 11)]
    assert diagnose(model, big, batch, lr_history=warmup, compare_strategies=False).cause == "scale_overflow"
    assert diagnose(model, ce, batch, lr_history=[1e-3] * 5 + [1e-1], compare_strategies=False).cause == "healthy"


def test_attention_logits_overflow_and_qk_norm_fixes_them() -> None:
    def gpt(qk_norm: bool) -> GPT:
        torch.manual_seed(0)
        model = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, attention="explicit", qk_norm=qk_norm)
        with torch.no_grad():
            model.blocks[0].qkv.weight[:64].mul_(2000.0)
        return model

    batch = (torch.randint(32, (4, 16)), torch.randint(32, (4, 16)))
    d = diagnose(gpt(False), ce, batch, compare_strategies=False)
    assert d.cause == "forward_overflow" and d.first_module == "blocks.0.scores" and "QK-norm" in d.fix
    assert diagnose(gpt(True), ce, batch, compare_strategies=False).cause != "forward_overflow"


def test_json_and_text_carry_the_verdict() -> None:
    model, batch = mlp()
    with torch.no_grad():
        model.layers[1][0].weight.mul_(1e6)
    d = diagnose(model, ce, batch)
    data = json.loads(d.to_json())
    assert data["cause"] == "forward_overflow" and data["exit_code"] == 3 and data["first_module"] == "layers.1.0"
    assert d.text().startswith("verdict: FORWARD_OVERFLOW")
    assert d.one_line().startswith("doctor: forward_overflow at layers.1.0: forward overflow in fp16")
    assert "\n" not in d.one_line()
    assert set(EXIT_CODES) == set(CAUSES) and 2 not in EXIT_CODES.values()


@pytest.mark.parametrize("kwargs,message", [
    ({"precision": "fp8"}, "precision must be one of fp16, bf16, got 'fp8'"),
    ({"scale": 0.0}, "scale must be finite and > 0, got 0.0"),
    ({"scale": math.inf}, "scale must be finite and > 0, got inf"),
    ({"underflow_threshold": 1.5}, "underflow_threshold must be in (0, 1), got 1.5"),
])
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str) -> None:
    model, batch = mlp()
    with pytest.raises(ValueError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        diagnose(model, ce, batch, **kwargs)


def test_an_intentional_minus_inf_mask_is_not_an_overflow() -> None:
    # blocks.0.scores outputs -inf above the diagonal in fp32 too: the overflow is at fc_out.
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=64, attention="explicit", ffn_gain=3000.0)
    batch = (torch.randint(32, (4, 16)), torch.randint(32, (4, 16)))
    d = diagnose(model, ce, batch, compare_strategies=False)
    assert d.cause == "forward_overflow" and d.first_module == "blocks.0.fc_out"
    assert 65504 < d.value < math.inf


def test_strategies_are_compared_on_a_model_whose_forward_saves_its_weights() -> None:
    # LayerNorm runs in fp32 under autocast and saves its weight for backward: a strategy's
    # optimizer step must not bump that weight's version, or the retained graph is unusable.
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    batch = (torch.randint(32, (4, 16)), torch.randint(32, (4, 16)))
    d = diagnose(model, lambda m, b: ce(m, b) * 1e-8, batch)
    assert {"native", "static", "max_ema"} <= set(d.strategy_scales) and "layerwise" in d.not_compared
    assert len({x.scale for x in d.per_layer}) >= 3


def test_a_forward_hooking_strategy_gets_its_own_forward_and_chooses_what_it_would_in_training() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    batch = (torch.randint(32, (4, 16)), torch.randint(32, (4, 16)))
    loss_fn = lambda m, b: ce(m, b) * 1e-8  # noqa: E731
    d = diagnose(model, loss_fn, batch, strategy_names=["underflow_target", "native"], forward_strategies=True)
    assert d.passes["forward"] == 3 and not d.not_compared
    ref = strategies.create("underflow_target").attach(model)  # the same step, as a training loop runs it
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, batch)
    ref.scale(loss).backward()
    ref.step(torch.optim.SGD(model.parameters(), lr=0.0))
    ref.update()
    assert d.strategy_scales["underflow_target"] == ref.get_scale() > 2.0**16


def test_the_first_backward_overflow_is_first_in_backward_order() -> None:
    # A large middle layer: the head's weight gradient (computed first in backward) and later
    # activation gradients both overflow at 2^16; the head comes first.
    model, batch = mlp()
    with torch.no_grad():
        model.layers[1][0].weight.mul_(3000.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ce(model, batch)
    head_grad, = torch.autograd.grad(loss * 2.0**16, [model.head.weight])
    assert not torch.isfinite(head_grad).all()  # the reference: the head's own fp16 weight gradient
    d = diagnose(model, ce, batch, compare_strategies=False)
    assert d.cause == "scale_overflow" and (d.first_module, d.tensor) == ("head", "head parameter gradient")
