"""`layerwise` with `rule: adaloss` against a re-statement of the reference code
(kumasento/gradient-scaling, ada_loss/chainer_impl/ada_loss.py: get_loss_scale_by_approx_range,
bound_loss_scale_by_heuristics, get_power_of_two_scale), and on a deep narrow fp16 MLP whose
input-side layers underflow under one global scale."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.special import erfinv

import strategies
from strategies.rules.adaloss import adaloss_update_
from tests.helpers import linear_output_grads, mlp


def reference_scales(g_sigma2, g_max, w_sigma2, w_max, fan, n_uf=1e-3, u_min=6.0e-8, u_max=65504.0,
                     scale_upper_bound=16.0, accum_upper_bound=1024.0):
    """The reference, layer by layer from the loss: approx range, bounds, power of two; the
    cumulative scale carried down as prev_scale (starting at 1)."""
    n_uf_threshold = erfinv(n_uf) * np.sqrt(2)
    prev, out = 1.0, []
    for l in range(len(g_sigma2) - 1, -1, -1):
        o_sigma = np.sqrt(g_sigma2[l] * w_sigma2[l])  # zero-mean product: (s_g^2 + mu_g^2)(s_w^2 + mu_w^2)
        loss_scale = 1.0 if o_sigma == 0 else max(u_min / (n_uf_threshold * o_sigma), 1.0)
        if o_sigma != 0:
            loss_scale = min(loss_scale, (u_max / fan[l]) / (g_max[l] * w_max[l]))
        loss_scale = min(accum_upper_bound / prev, loss_scale)
        loss_scale = min(scale_upper_bound, loss_scale)
        cum = np.power(2.0, np.floor(np.log2(prev * loss_scale)))  # the gradient carries prev * scale
        out.append(cum)
        prev = cum
    return out[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_scales_equal_the_reference_restated(seed: int) -> None:
    rng = np.random.default_rng(seed)
    G = 5
    g2 = 10.0 ** rng.uniform(-16, -2, G)
    w2 = 10.0 ** rng.uniform(-4, 0, G)
    gmax = np.sqrt(g2) * rng.uniform(2, 50, G)
    wmax = np.sqrt(w2) * rng.uniform(2, 8, G)
    fan = rng.integers(4, 512, G).astype(float)
    scales = torch.ones(G)
    n = torch.ones(G)  # g2 given as a mean: sum / n with n = 1
    adaloss_update_(scales, torch.zeros(G, dtype=torch.bool), torch.zeros(()), torch.tensor(g2, dtype=torch.float32),
                    n, torch.tensor(gmax, dtype=torch.float32), torch.tensor(w2, dtype=torch.float32),
                    torch.tensor(wmax, dtype=torch.float32), torch.tensor(fan, dtype=torch.float32),
                    1e-3, 6.0e-8, 65504.0, 16.0, 1024.0, 0.5)
    ref = reference_scales(g2, gmax, w2, wmax, fan)
    assert scales.tolist() == pytest.approx(ref, rel=0), (scales.tolist(), ref)


def test_a_skipped_step_backs_off_only_the_blamed_groups() -> None:
    scales = torch.tensor([64.0, 8.0, 1.0])
    adaloss_update_(scales, torch.tensor([False, True, False]), torch.ones(()), *(torch.ones(3) for _ in range(6)),
                    1e-3, 6.0e-8, 65504.0, 16.0, 1024.0, 0.5)
    assert scales.tolist() == [64.0, 4.0, 1.0]


def deep_narrow(depth: int = 10, gain: float = 0.15) -> torch.nn.Sequential:
    """Small weights: the gradient shrinks layer by layer towards the input."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(depth):
        lin = torch.nn.Linear(16, 16)
        with torch.no_grad():
            lin.weight.mul_(gain)
        mods += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(16, 1))


def run(name: str, **kw) -> tuple[float, int]:
    """fp16 autocast, loss x 1e4 (the output side needs a small scale): the input layer's
    activation-gradient zero fraction over the last steps, and the skipped steps."""
    model = deep_narrow()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = strategies.create(name, **kw).attach(model)
    seen: list[float] = []

    def watch(module, inputs, output):
        output.register_hook(lambda g: seen.append((g == 0).float().mean().item()))

    model[0].register_forward_hook(watch)
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for _ in range(16):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        s.scale(F.mse_loss(out.float(), y) * 1e4).backward()
        s.step(opt)
        s.update()
    return sum(seen[-4:]) / 4, int(s.telemetry()["skipped_steps"].item())


def test_per_group_scales_rescue_the_input_side_that_one_global_scale_loses() -> None:
    (native_zero, native_skips), (ada_zero, ada_skips) = run("native"), run("layerwise", rule="adaloss", init_scale=1.0)
    assert native_zero > 0.2 and ada_zero < 0.02, (native_zero, ada_zero)
    assert ada_skips < native_skips


@pytest.mark.parametrize("bad,message", [
    (dict(underflow_rate=1.0), "underflow_rate must be in (0, 1), got 1.0"),
    (dict(layer_cap=1.0), "layer_cap must be > 1, got 1.0"),
    (dict(total_cap=0.5), "total_cap must be > 1, got 0.5"),
    (dict(format_min=0.0), "format_min must be finite and > 0, got 0.0"),
])
def test_adaloss_parameters_are_validated(bad, message) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("layerwise", rule="adaloss", **bad)
    assert str(e.value) == message


def test_weight_statistics_equal_a_plain_computation() -> None:
    """Per group: mean square and abs-max over the weight matrices only (vectors ignored), the
    largest shape[0] as fan; a group without a matrix gets (1, 1, 1)."""
    from strategies.rules.adaloss import WeightStats

    torch.manual_seed(0)
    groups = [[torch.randn(8, 4), torch.randn(4)], [torch.randn(5)], [torch.randn(16, 8) * 3, -torch.rand(3, 3) * 40]]
    w2, wmax, fan = WeightStats(groups, torch.device("cpu"))()
    mats = [[w for w in g if w.dim() >= 2] for g in groups]
    want_w2 = [float(sum(m.double().square().sum() for m in g) / sum(m.numel() for m in g)) if g else 1.0 for g in mats]
    assert w2.tolist() == pytest.approx(want_w2, rel=1e-6)
    assert wmax.tolist() == [max(m.abs().max().item() for m in g) if g else 1.0 for g in mats]
    assert fan.tolist() == [8.0, 1.0, 16.0]


def test_recorded_gradient_statistics_are_those_of_each_groups_output_gradient() -> None:
    """At unscale_, each group's (sum of squares, count, abs-max) are those of the fp32 gradient of
    its output (a plain backward, hooks on a copy), for groups at different scales."""
    model = mlp(seed=2, width=16, depth=4)
    ref = copy.deepcopy(model)
    grads = linear_output_grads(ref)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    F.mse_loss(ref(x), y).backward()
    s = strategies.create("layerwise", rule="adaloss", init_scale=1.0).attach(model)
    s.scale(torch.ones(()))
    sd = s.state_dict()
    sd["extra"]["scale"] = [2.0**9, 2.0**5, 2.0**-3, 2.0**2]
    s.load_state_dict(sd)
    s.scale(F.mse_loss(model(x), y)).backward()
    s.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    st = s.state
    want = [grads[k] for k in range(4)]
    assert st.ada_n.tolist() == [float(g.numel()) for g in want]
    assert st.ada_g2.tolist() == pytest.approx([float(g.double().square().sum()) for g in want], rel=1e-5)
    assert st.ada_gmax.tolist() == pytest.approx([float(g.abs().max()) for g in want], rel=1e-6)
