"""``stats_every`` (strategies/schedule.py): k = 1 is today's rule bit for bit; with k > 1 the
rule reads statistics only on steps 0, k, 2k, ... and equals the k = 1 rule run on those steps
alone, while an Inf on any step is still skipped and backs the scale off."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
import strategies.gather as gather_module
from strategies.schedule import sampled
from tests.helpers import linear_output_grads, mlp

RULES = ["max_ema", "amax_history", "learned", "hybrid", "layerwise"]


def grads_seq(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradient magnitudes that move by several octaves, so the rules' scales change each step."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, generator=gen) * 2.0 ** (4 * math.sin(j) + 6) for j in range(n)]


def run(strategy, grads: list[torch.Tensor], lr: float = 0.0) -> tuple[list[list[float]], torch.Tensor]:
    """Each gradient given as the scaled gradient of one parameter; scales after every update."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.SGD([p], lr=lr)
    out = []
    for g in grads:
        strategy.scale(torch.ones(()))
        p.grad = g * strategy.get_scale()
        strategy.step(opt)
        strategy.update()
        out.append(strategy.state.scale.reshape(-1).tolist())
    return out, p.detach().clone()


@pytest.mark.parametrize("name", RULES)
def test_stats_every_one_is_the_rule_bit_for_bit(name) -> None:
    grads = grads_seq(12)
    grads[5] = grads[5].clone()
    grads[5][3] = math.inf
    want, _ = run(strategies.create(name), grads)
    got, _ = run(strategies.create(name, stats_every=1, stats_layers=1.0), grads)
    assert got == want


@pytest.mark.parametrize("name", ["max_ema", "amax_history", "learned", "layerwise"])
def test_stats_every_k_is_the_rule_on_the_statistic_steps_alone(name) -> None:
    """Clean steps: with k = 3 the scale after step 3m+j (j < 3) is the k = 1 rule's after its
    m-th step fed only gradients 0, 3, 6, ...; nothing moves on the steps in between."""
    k, grads = 3, grads_seq(12, seed=1)
    got, _ = run(strategies.create(name, stats_every=k), grads)
    alone, _ = run(strategies.create(name), grads[::k])
    assert got == [alone[j // k] for j in range(len(grads))]
    assert len({tuple(s) for s in alone}) > 2  # the rule really moves


def test_statistics_are_gathered_only_on_statistic_steps(monkeypatch) -> None:
    calls = []
    real = gather_module.unscale_and_stats
    monkeypatch.setattr(gather_module, "unscale_and_stats", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    run(strategies.create("max_ema", stats_every=4), grads_seq(8))
    assert len(calls) == 2  # steps 0 and 4


@pytest.mark.parametrize("name", RULES)
def test_an_overflow_between_statistic_steps_is_skipped_and_backs_off(name) -> None:
    grads = grads_seq(6, seed=2)
    grads[4] = grads[4].clone()
    grads[4][0] = math.nan  # step 4: not a statistic step with k = 3
    s = strategies.create(name, stats_every=3)
    scales, _ = run(s, grads[:4], lr=0.1)
    p = torch.nn.Parameter(torch.ones(64))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(torch.ones(()))
    p.grad = grads[4] * s.get_scale()
    p_before = p.detach().clone()
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), p_before)  # skipped
    assert s.state.scale.reshape(-1).tolist() == [v * 0.5 for v in scales[-1]]  # backed off (one group)
    assert int(s.state.skipped_steps) == 1


def test_layerwise_hold_backs_off_only_the_group_the_overflow_starts_in() -> None:
    model = mlp(seed=1, width=8, depth=3)
    s = strategies.create("layerwise", stats_every=2).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(3):  # statistic step, hold, statistic step
        s.scale(F.mse_loss(model(x), y)).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    before = s.state.scale.clone()
    s.scale(F.mse_loss(model(x), y)).backward()  # step 3: a hold step; poison group 0's own gradient
    model[0].weight.grad[0, 0] = math.inf
    s.step(opt)
    s.update()
    assert s.state.scale.tolist() == [before[0].item() * 0.5, *before[1:].tolist()]


def test_underflow_target_observes_only_in_statistic_steps() -> None:
    model = mlp(seed=3, width=8, depth=3)
    s = strategies.create("underflow_target", stats_every=2).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    seen = []
    for _ in range(4):
        s.scale(F.mse_loss(model(x), y)).backward()
        seen.append(float(s.state.exp_hist.sum()))
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert seen[0] > 0 and seen[2] > 0 and seen[1] == 0 and seen[3] == 0


def test_stats_every_is_validated() -> None:
    with pytest.raises(ValueError, match="stats_every must be an integer >= 1, got 0"):
        strategies.create("max_ema", stats_every=0)


# ------------------------------------------------------------------ stats_layers
def test_sampled_indices_are_an_evenly_spread_share_from_the_first() -> None:
    assert sampled(8, 1.0) == list(range(8))
    assert sampled(8, 0.5) == [0, 2, 4, 6]
    assert sampled(8, 0.25) == [0, 4]
    assert sampled(3, 0.01) == [0]  # at least one


def test_stats_layers_reads_the_sampled_tensors_and_checks_all() -> None:
    """Statistics (abs-max, sum of squares, count) of the sampled half of eight gradients, equal
    to a plain computation over those; an Inf in an unsampled one still skips the step."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.zeros(32)) for _ in range(8)]
    grads = [torch.randn(32, generator=gen) * 2.0 ** j for j in range(8)]
    opt = torch.optim.SGD(params, lr=0.1)
    s = strategies.create("max_ema", stats_layers=0.5)
    s.scale(torch.ones(()))
    scale = s.get_scale()
    for p, g in zip(params, grads):
        p.grad = g * scale
    s.step(opt)
    s.update()
    t = s.telemetry()
    picked = [grads[j] for j in sampled(8, 0.5)]
    assert t["grad_absmax"].item() == max(g.abs().max().item() for g in picked)
    assert t["grad_norm"].item() == pytest.approx(math.sqrt(sum(float(g.double().square().sum()) for g in picked)),
                                                  rel=1e-6)
    before = [p.detach().clone() for p in params]
    s.scale(torch.ones(()))
    for j, p in enumerate(params):
        p.grad = grads[j] * s.get_scale()
    params[7].grad[3] = math.inf  # tensor 7 is not sampled
    s.step(opt)
    s.update()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert int(s.state.skipped_steps) == 1


def test_underflow_target_observes_the_sampled_boundaries() -> None:
    """With stats_layers 0.5 the histogram counts the nonzero output gradients of layers 0 and 2
    of four (a plain backward with hooks on a copy gives them)."""
    model = mlp(seed=4, width=8, depth=4)
    ref = copy.deepcopy(model)
    grads = linear_output_grads(ref)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    F.mse_loss(ref(x), y).backward()
    s = strategies.create("underflow_target", stats_layers=0.5).attach(model)
    s.scale(F.mse_loss(model(x), y)).backward()
    want = sum(int((grads[k] != 0).sum()) for k in sampled(4, 0.5))
    assert sampled(4, 0.5) == [0, 2] and int(s.state.exp_hist.sum()) == want


def test_stats_layers_is_validated() -> None:
    with pytest.raises(ValueError, match=r"stats_layers must be in \(0, 1\], got 1.5"):
        strategies.create("max_ema", stats_layers=1.5)
    with pytest.raises(ValueError, match="stats_layers must be 1.0 for layerwise"):
        strategies.create("layerwise", stats_layers=0.5)
