"""`layerwise`: exact boundary rescaling, parity with `native` at equal scales, per-group
adaptation on a deep fp16 MLP, overflow attribution, hooks' life cycle."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.helpers import forbid_host_sync, params_equal

INF = math.inf
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny fp16-autocast models: one thread (conftest.py)


class Poison(torch.nn.Module):
    """Identity forward; backward multiplies the gradient by ``factor`` (set it to inf to inject)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Mul.apply(x, self)


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):  # type: ignore[override]
        ctx.mod = mod
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.mod.factor, None


def deep_mlp(depth: int = 4, width: int = 8, gain: float = 1.0, seed: int = 0, poison_at: int | None = None):
    """``depth`` blocks Linear(+Poison)+Tanh, then a Linear head: groups "0".."depth"."""
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for k in range(depth):
        lin = torch.nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.mul_(gain)
        inner = [lin, Poison(), torch.nn.Tanh()] if k == poison_at else [lin, torch.nn.Tanh()]
        mods.append(torch.nn.Sequential(*inner))
    mods.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*mods)


def data(step: int, n: int = 32, width: int = 8):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)


def step_once(model, opt, s, step, *, autocast=True, poison_param=False):
    x, y = data(step)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = F.mse_loss(model(x).float(), y)
    s.scale(loss).backward()
    if poison_param:
        model[-1].weight.grad.view(-1)[0] = INF
    s.step(opt)
    s.update()


def set_scales(s, scales: list[float]) -> None:
    sd = s.state_dict()
    sd["extra"]["scale"] = scales  # per-group state is saved under its state name
    s.load_state_dict(sd)


# ------------------------------------------------------------------ (a) parity at equal scales
@pytest.mark.parametrize("rule,steps", [("backoff_growth", 6), ("max_ema", 1)])
def test_equal_group_scales_give_native_updates_bit_for_bit(rule: str, steps: int) -> None:
    a, b = deep_mlp(seed=1), deep_mlp(seed=1)
    oa, ob = torch.optim.Adam(a.parameters(), lr=1e-2), torch.optim.Adam(b.parameters(), lr=1e-2)
    lw = strategies.create("layerwise", init_scale=2.0**10, rule=rule, growth_interval=10**6).attach(a)
    nat = strategies.create("native", init_scale=2.0**10, growth_interval=10**6)
    assert lw.num_groups == 5
    for step in range(steps):
        step_once(a, oa, lw, step)
        step_once(b, ob, nat, step)
        assert params_equal(a, b), f"step {step}"
    if rule == "backoff_growth":
        assert lw.telemetry()["scales"].tolist() == [2.0**10] * 5


# ------------------------------------------------------------------ exactness at unequal scales
def test_unequal_power_of_two_scales_are_exact_in_fp32() -> None:
    model = deep_mlp(seed=2)
    ref = copy.deepcopy(model)
    x, y = data(0)
    F.mse_loss(ref(x), y).backward()
    s = strategies.create("layerwise").attach(model)
    s.scale(torch.ones(()))  # initialise, then give every group its own scale
    set_scales(s, [2.0**3, 2.0**12, 2.0**-5, 2.0**9, 2.0**1])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaled = s.scale(F.mse_loss(model(x), y))
    assert scaled.item() == F.mse_loss(model(x), y).item() * 2.0  # the head's scale
    scaled.backward()
    assert model[0][0].weight.grad.abs().max() > 2.0**2 * ref[0][0].weight.grad.abs().max()  # carries 2^3
    s.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


class Shared(torch.nn.Module):
    """Calls block ``a`` twice: a, b, a, head — a module used at two places of the chain."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(self.b(self.a(x)).relu()))


def test_a_module_called_twice_is_rescaled_per_call() -> None:
    model = Shared()
    ref = copy.deepcopy(model)
    x, y = data(1)
    F.mse_loss(ref(x), y).backward()
    s = strategies.create("layerwise").attach(model)
    assert s.group_names == ["a", "b", "head"]
    s.scale(torch.ones(()))
    set_scales(s, [2.0**7, 2.0**-3, 2.0**2])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(F.mse_loss(model(x), y)).backward()
    s.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


# ------------------------------------------------------------------ (b) a deep fp16 MLP
def early_zero_fraction(name: str, steps: int = 30) -> tuple[float, torch.Tensor]:
    model = deep_mlp(depth=12, gain=0.2, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = strategies.create(name).attach(model)
    seen: dict[str, float] = {}

    def watch(mod, args, out):  # the pre-activation gradient inside block 0
        out.register_hook(lambda g: seen.__setitem__("zero", (g == 0).float().mean().item()))

    model[0][0].register_forward_hook(watch)
    for step in range(steps):
        step_once(model, opt, s, step)
    return seen["zero"], s.telemetry().get("scales", s.telemetry()["scale"])


def test_deep_fp16_mlp_group_scales_separate_and_early_underflow_falls() -> None:
    # Each block attenuates the backward signal ~8x: the first block's activation gradients sit
    # ~2^36 below the head's -- more than fp16's range, so one global scale must flush them.
    native_zero, native_scale = early_zero_fraction("native")
    lw_zero, scales = early_zero_fraction("layerwise")
    assert scales.shape == (13,)
    assert (scales[:-1] >= scales[1:]).all()  # input-side groups get the larger scales
    assert scales[0] / scales[-1] >= 2.0**12
    assert all(math.log2(v) == int(math.log2(v)) for v in scales.tolist())  # powers of two
    assert native_zero > 0.9
    assert lw_zero < 0.05


# ------------------------------------------------------------------ (c) overflow attribution
@pytest.mark.parametrize("where", [0, 2, 4])
def test_overflow_inside_one_group_backs_off_that_group_only(where: int) -> None:
    model = deep_mlp(seed=4, poison_at=where if where < 4 else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s = strategies.create("layerwise").attach(model)
    for step in range(3):
        step_once(model, opt, s, step)
    before = s.telemetry()["scales"].clone()
    params = [p.detach().clone() for p in model.parameters()]
    if where < 4:
        model[where][1].factor = INF  # inside block `where`: its own and every lower group go non-finite
    step_once(model, opt, s, 3, poison_param=(where == 4))  # group 4 (the head): its weight grad
    t = s.telemetry()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))  # whole step skipped
    assert t["found_inf"].item() == 1.0
    expect = before.clone()
    expect[where] *= 0.5
    assert torch.equal(t["scales"], expect)
    assert t["overflow_origin"].tolist() == [1.0 if g == where else 0.0 for g in range(5)]


def test_backoff_growth_rule_per_group_table() -> None:
    # growth_interval 2: step 1 overflows in group 1 only -> group 1 halves, every tracker restarts;
    # two clean steps later every group grows.
    model = deep_mlp(seed=5, poison_at=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = strategies.create("layerwise", init_scale=2.0**10, rule="backoff_growth", growth_interval=2).attach(model)
    rows = []
    for step in range(4):
        model[1][1].factor = INF if step == 1 else 1.0
        step_once(model, opt, s, step)
        rows.append([int(math.log2(v)) for v in s.telemetry()["scales"].tolist()])
    assert rows == [[10] * 5, [10, 9, 10, 10, 10], [10, 9, 10, 10, 10], [11, 10, 11, 11, 11]]


# ------------------------------------------------------------------ drop-in, life cycle, errors
def test_unattached_is_a_single_group_max_ema_with_power_of_two_scales() -> None:
    a, b = deep_mlp(seed=6), deep_mlp(seed=6)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.05), torch.optim.SGD(b.parameters(), lr=0.05)
    lw = strategies.create("layerwise")
    me = strategies.create("max_ema", round_pow2=True)
    for step in range(8):
        step_once(a, oa, lw, step, poison_param=(step == 4))
        step_once(b, ob, me, step, poison_param=(step == 4))
        assert lw.get_scale() == me.get_scale()
    assert lw.num_groups == 1 and params_equal(a, b)


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_detach_removes_every_hook_and_returns_to_one_group() -> None:
    model = deep_mlp(seed=7)
    base = hook_count(model)
    s = strategies.create("layerwise").attach(model)
    assert hook_count(model) == base + 2 + 2 * 5  # the root's pre/post hooks, each group's pre/post hook
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        step_once(model, opt, s, step)
    out_scale = s.get_scale()
    s.detach()
    assert hook_count(model) == base and s.num_groups == 1 and s.group_names == ["all"]
    assert s.get_scale() == out_scale and s.telemetry()["scales"].tolist() == [out_scale]
    step_once(model, opt, s, 3)
    assert s.telemetry()["found_inf"].item() == 0.0
    s.attach(model)
    s.attach(model)  # re-attaching replaces, never stacks
    assert hook_count(model) == base + 2 + 2 * 5  # the root's pre/post hooks, each group's pre/post hook


def test_attached_steps_never_sync() -> None:
    model = deep_mlp(seed=8, poison_at=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = strategies.create("layerwise").attach(model)
    for step in range(4):
        model[1][1].factor = INF if step == 2 else 1.0
        x, y = data(step)
        opt.zero_grad()
        with forbid_host_sync():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            s.scale(loss).backward()  # the boundary hooks run here
            s.unscale_(opt)
        s.step(opt)
        with forbid_host_sync():
            s.update()
    assert s.telemetry()["skipped_steps"].item() == 1


def test_state_dict_round_trip_with_groups() -> None:
    a = deep_mlp(seed=9)
    oa = torch.optim.SGD(a.parameters(), lr=0.05)
    s = strategies.create("layerwise").attach(a)
    for step in range(4):
        step_once(a, oa, s, step)
    b = deep_mlp(seed=9)  # not deepcopy(a): that would copy a's hooks (and with them the strategy)
    b.load_state_dict(a.state_dict())
    ob = torch.optim.SGD(b.parameters(), lr=0.05)
    s2 = strategies.create("layerwise").attach(b)
    s2.load_state_dict(s.state_dict())  # before lazy initialisation: applied when it happens
    s2.scale(torch.ones(()))
    assert torch.equal(s2.telemetry()["scales"], s.telemetry()["scales"])
    for step in range(4, 8):
        step_once(a, oa, s, step)
        step_once(b, ob, s2, step)
    assert torch.equal(s2.telemetry()["scales"], s.telemetry()["scales"]) and params_equal(a, b)
    s3 = strategies.create("layerwise", groups=["0", "1", "2", "3*", "4"]).attach(deep_mlp(seed=9))
    s3.scale(torch.ones(()))
    with pytest.raises(ValueError, match="attach"):
        s3.load_state_dict(s.state_dict())


def test_group_patterns_and_coverage_errors() -> None:
    model = deep_mlp(depth=4, seed=10)
    s = strategies.create("layerwise", groups=["0", "[12]", "3", "4"]).attach(model)
    assert s.group_names == ["0", "[12]", "3", "4"]
    with pytest.raises(ValueError, match=r"groups pattern 'head' matches no module"):
        strategies.create("layerwise", groups=["head", "*"]).attach(model)
    with pytest.raises(ValueError, match=r"parameters \['4.weight', '4.bias'\] belong to no group"):
        strategies.create("layerwise", groups=["[0-3]"]).attach(model)


# ------------------------------------------------------------------ the project's own models
def _project_models():
    from experiments.workloads.models import CNN, GPT, MLP

    torch.manual_seed(0)
    return [
        (GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16), torch.randint(0, 16, (2, 8)),
         lambda o: F.cross_entropy(o.reshape(-1, 16), torch.arange(16)),
         ["embed", "blocks.0", "blocks.1", "ln_f", "head"]),
        (MLP(in_features=8, num_classes=4, width=16, depth=3), torch.randn(4, 8),
         lambda o: F.cross_entropy(o, torch.tensor([0, 1, 2, 3])), ["layers.0", "layers.1", "layers.2", "head"]),
        (CNN(in_channels=1, num_classes=4, width=4, depth=2), torch.randn(2, 1, 8, 8),
         lambda o: F.cross_entropy(o, torch.tensor([0, 1])), ["convs.0", "convs.1", "head"]),
    ]


@pytest.mark.parametrize("k", range(3), ids=["gpt", "mlp", "cnn"])
def test_default_groups_of_the_project_models_are_exact(k: int) -> None:
    """Default grouping looks inside ModuleLists; with unequal scales (residual blocks, layer
    norms, attention, pooling, glue ops between groups) the unscaled gradients are those of an
    unscaled fp32 backward, bit for bit."""
    model, x, loss_fn, names = _project_models()[k]
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    s = strategies.create("layerwise").attach(model)
    assert s.group_names == names
    s.scale(torch.ones(()))
    set_scales(s, [2.0**3, 2.0**12, 2.0**-5, 2.0**9, 2.0**1][: s.num_groups])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(loss_fn(model(x))).backward()
    s.unscale_(opt)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_group_that_is_never_called_is_refused() -> None:
    """A ModuleList group: its members' ops feed ``head`` at head's scale, refused at the forward
    that does it; groups with gradients none of whose modules ran since the update, at ``unscale_``."""
    model, x, loss_fn, _ = _project_models()[1]
    s = strategies.create("layerwise", groups=["layers", "head"]).attach(model)  # a ModuleList: never called
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"parameter 'layers\.2\.0\.weight' \(group 'layers'\) is used outside the "
                                         r"calls of its group's modules, by ops at group 'head''s scale"):
        model(x)
    model, x, loss_fn, _ = _project_models()[1]
    s = strategies.create("layerwise").attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = loss_fn(model(x))
    s.scale(loss).backward(retain_graph=True)
    s.unscale_(opt)
    s.update()
    opt.zero_grad()
    s.scale(loss).backward()  # the last step's graph again: no group module ran since the update
    with pytest.raises(RuntimeError, match=r"group 'layers.0' has gradients but none of its modules was called"):
        s.unscale_(opt)


def test_manual_update_sets_every_group_to_a_power_of_two() -> None:
    model = deep_mlp(seed=11)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = strategies.create("layerwise").attach(model)
    step_once(model, opt, s, 0)
    set_scales(s, [2.0**4, 2.0**9, 2.0**2, 2.0**7, 2.0**5])
    x, y = data(1)
    s.scale(F.mse_loss(model(x), y)).backward()
    s.step(opt)
    s.update(3.0)  # as GradScaler.update(new_scale); rounded down to keep the rescaling exact
    assert s.telemetry()["scales"].tolist() == [2.0] * 5 and s.get_scale() == 2.0


@pytest.mark.parametrize("entry,value,message", [
    ("scale", [2.0**4, math.nan, 2.0**4, 2.0**4, 2.0**4], r"'scale\[1\]' must be finite"),
    ("scale", [2.0**4] * 3, "'scale' must be a list of 5 numbers"),
    ("ema", [0.0, 0.0, -math.inf, 0.0, 0.0], r"'ema\[2\]' must be finite"),
    ("ema_steps", [0, 0, 0, 0, -1], r"'ema_steps\[4\]' must be >= 0"),
])
def test_per_group_state_is_validated_before_loading(entry: str, value, message: str) -> None:
    model = deep_mlp(seed=12)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = strategies.create("layerwise").attach(model)
    for step in range(2):
        step_once(model, opt, s, step)
    before = s.state_dict()
    bad = copy.deepcopy(before)
    bad["extra"][entry] = value
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(bad)
    assert s.state_dict() == before
