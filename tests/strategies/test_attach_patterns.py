"""The attach-based rules (`layerwise` and its rules/presets, `underflow_target`) under the patterns
of PyTorch's "Automatic Mixed Precision examples" and real models: each gives GradScaler's
unscaled gradients at the same power-of-two scales when nothing under/overflows, or refuses with
one clear error. Gradient penalty, accumulation with clipping and a custom Function, state_dict
into a new strategy mid-run, models attached through a container called in another order,
several models and losses, a second strategy on the same model, unscaled backwards, models called
one by one for many steps (nothing of a step's graph survives it), and a torchvision-style ResNet
(in-place ReLU after a hooked BatchNorm, residual blocks, downsample shortcuts)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import strategies
from strategies.boundaries import Boundaries

LAYERWISE = [{}, {"rule": "backoff_growth"}, {"rule": "adaloss"}]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny fp16-autocast models: one thread (conftest.py)


def set_scales(s, scales: list[float]) -> None:
    s.scale(torch.ones(()))  # initialise the state
    sd = s.state_dict()
    sd["extra"]["scale"] = scales
    s.load_state_dict(sd)


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))


def gradscaler_step(model: nn.Module, loss_of, scale: float = 2.0**10) -> list[torch.Tensor]:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(loss_of(model)).backward()
    scaler.unscale_(opt)
    return [p.grad.clone() for p in model.parameters()]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


# ---------------------------------------------------------------------------- 1. gradient penalty
def penalty_grads(scaler, model: nn.Module, x: torch.Tensor, y: torch.Tensor, helper: bool) -> list[torch.Tensor]:
    """PyTorch's AMP-examples gradient penalty, with ``unscale_grads`` (helper) or 1/get_scale()."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    loss = F.mse_loss(model(x), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    if helper:
        grads = scaler.unscale_grads(scaled_grads, params)
    else:
        inv = 1.0 / scaler.get_scale()
        grads = [g * inv for g in scaled_grads]
    penalty = sum(g.pow(2).sum() for g in grads)
    scaler.scale(loss + penalty).backward()
    scaler.unscale_(opt)
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("kw", LAYERWISE)
def test_gradient_penalty_with_unscale_grads_equals_gradscaler(kw: dict) -> None:
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randn(16, 2)
    want = penalty_grads(torch.amp.GradScaler("cpu", init_scale=2.0**10), mlp(0), x, y, helper=False)
    model = mlp(0)
    s = strategies.create("layerwise", **kw).attach(model)
    set_scales(s, [2.0**4, 2.0**18, 2.0**10])
    got = penalty_grads(s, model, x, y, helper=True)
    for g, w in zip(got, want):  # second-order terms: same maths, other summation order
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert not all(torch.equal(g, w) for g, w in zip(got, penalty_grads(
        torch.amp.GradScaler("cpu", init_scale=2.0**10), mlp(0), x, y * 0 + 5, helper=False)))


def test_gradient_penalty_with_underflow_target_is_gradscalers_recipe() -> None:
    """A global scale: GradScaler's own recipe (1 / get_scale()) is exact."""
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randn(16, 2)
    want = penalty_grads(torch.amp.GradScaler("cpu", init_scale=2.0**10), mlp(0), x, y, helper=False)
    model = mlp(0)
    s = strategies.create("underflow_target", init_scale=2.0**10).attach(model)
    got = penalty_grads(s, model, x, y, helper=False)
    for g, w in zip(got, want):  # second-order terms: same maths, other summation order
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    s.detach()


def test_naive_gradient_penalty_is_refused_at_get_scale_and_unscale() -> None:
    model = mlp(0)
    s = strategies.create("layerwise").attach(model)
    set_scales(s, [2.0**4, 2.0**18, 2.0**10])
    x = torch.randn(8, 4)
    loss = model(x).square().mean()
    scaled = torch.autograd.grad(s.scale(loss), list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match=r"get_scale\(\) after a create_graph backward.*unscale_grads"):
        s.get_scale()
    s.scale(loss + sum(g.sum() for g in scaled)).backward()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) after a create_graph backward.*unscale_grads"):
        s.step(torch.optim.SGD(model.parameters(), lr=0.0))
    s.unscale_grads(scaled, list(model.parameters()))
    assert s.get_scale() == 2.0**10


class Cube(torch.autograd.Function):
    """A custom autograd function inside a group (AMP examples: custom autograd functions)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class WithCube(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.a, self.b, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(Cube.apply(torch.tanh(self.b(torch.tanh(self.a(x))))))


@pytest.mark.parametrize("name,kw", [("layerwise", {}), ("layerwise", {"rule": "adaloss"}),
                                     ("underflow_target", {"init_scale": 2.0**10})])
def test_accumulation_clipping_and_custom_functions_give_gradscaler_gradients(name: str, kw: dict) -> None:
    """AMP examples: 3 accumulated micro-batches, clipping after unscale_, a custom Function."""
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def run(scaler, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for x in xs:
            scaler.scale(model(x).square().mean() / len(xs)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        return [p.grad.clone() for p in model.parameters()]

    want = run(torch.amp.GradScaler("cpu", init_scale=2.0**10), WithCube())
    model = WithCube()
    s = strategies.create(name, **kw).attach(model)
    if name == "layerwise":
        set_scales(s, [2.0**17, 2.0**3, 2.0**10])
    assert_equal(run(s, model), want)
    s.detach()


@pytest.mark.parametrize("name", ["layerwise", "underflow_target"])
def test_state_dict_into_a_new_attached_strategy_mid_run_continues_identically(name: str) -> None:
    """AMP examples: ``state_dict()`` into a new scaler; the new one attaches once the old one
    is detached (attaching it beside the old one is refused)."""
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def train(model, s, steps):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            s.scale(loss).backward()
            s.step(opt)
            s.update()

    ref_model, model = mlp(7), mlp(7)
    ref = strategies.create(name).attach(ref_model)
    train(ref_model, ref, 6)
    old = strategies.create(name).attach(model)
    train(model, old, 3)
    new = strategies.create(name)
    with pytest.raises(ValueError, match="already carries"):
        new.attach(model)
    sd = old.state_dict()
    old.detach()
    new.attach(model).load_state_dict(sd)
    train(model, new, 3)
    assert new.state_dict() == ref.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


# ---------------------------------------------------------------------------- 2. call order
class Both(nn.Module):
    """Two models listed as [b, a] and called a then b."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.models = nn.ModuleList([b, a])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.models[0](torch.tanh(self.models[1](x)))


def two_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8), nn.Tanh(),
                                                                                     nn.Linear(8, 1))


@pytest.mark.parametrize("through", ["container_forward", "one_by_one"])
def test_models_listed_in_another_order_than_called_get_gradscaler_gradients(through: str) -> None:
    a, b = two_models()
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss_of = lambda m: F.mse_loss(m(x), y)  # noqa: E731
    want = gradscaler_step(copy.deepcopy(Both(a, b)), loss_of)
    model = Both(a, b)
    s = strategies.create("layerwise").attach(model if through == "container_forward" else model.models)
    assert s.group_names == ["models.0", "models.1"] if through == "container_forward" else ["0", "1"]
    set_scales(s, [2.0**10, 2.0**20])  # b at 2^10, a at 2^20
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):  # every step: the loss side is b's group, whatever the registration order
        opt.zero_grad()
        s.scale(loss_of(model)).backward()
        s.unscale_(opt)
        assert s.output_group == 0 and s.get_scale() == 2.0**10
        assert_equal([p.grad for p in model.parameters()], want)
        s._per_optimizer_states.clear()


def test_two_models_feeding_one_loss_and_two_losses_with_retain_graph() -> None:
    """AMP examples, "several models, losses and optimizers": both outputs in both losses."""
    m0, m1 = mlp(4), mlp(5)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def run(scaler, models):
        opts = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
        o0, o1 = models[0](x), models[1](x)
        scaler.scale(F.mse_loss(2 * o0 + 3 * o1, y)).backward(retain_graph=True)
        scaler.scale(F.mse_loss(3 * o0 - 5 * o1, y)).backward()
        for o in opts:
            scaler.unscale_(o)
        return [p.grad.clone() for m in models for p in m.parameters()]

    want = run(torch.amp.GradScaler("cpu", init_scale=2.0**10), [copy.deepcopy(m0), copy.deepcopy(m1)])
    both = nn.ModuleList([m0, m1])
    s = strategies.create("layerwise", groups=["0.0", "0.2", "0.3", "1.0", "1.2", "1.3"]).attach(both)
    set_scales(s, [2.0**3, 2.0**12, 2.0**7, 2.0**15, 2.0**1, 2.0**10])
    assert_equal(run(s, [m0, m1]), want)


# ---------------------------------------------------------------------------- 3. second strategy, unscaled backward
@pytest.mark.parametrize("first,second", [("layerwise", "layerwise"), ("layerwise", "underflow_target"),
                                          ("underflow_target", "layerwise")])
def test_a_second_strategy_on_an_attached_model_is_refused(first: str, second: str) -> None:
    model = mlp(0)
    one = strategies.create(first).attach(model)
    with pytest.raises(ValueError, match=rf"already carries the boundary hooks of strategy '{first}'.*detach\(\)"):
        strategies.create(second).attach(model)
    with pytest.raises(ValueError, match="already carries"):  # through a container or a part of it alike
        strategies.create(second).attach(nn.ModuleList([model]))
    with pytest.raises(ValueError, match="already carries"):
        strategies.create(second).attach(model[2])
    one.detach()
    strategies.create(second).attach(model).detach()
    one.attach(model)  # re-attaching the same strategy replaces its own hooks
    one.attach(model)
    one.detach()


def test_unscaled_backwards_pass_the_boundaries_untouched() -> None:
    model, ref = mlp(1), mlp(1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    s = strategies.create("layerwise").attach(model)
    set_scales(s, [2.0**4, 2.0**18, 2.0**10])
    u = strategies.create("underflow_target")
    F.mse_loss(model(x), y).backward()  # e.g. a logging backward, no scale()
    F.mse_loss(ref(x), y).backward()
    assert_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    g = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    assert_equal(list(g), [p.grad for p in ref.parameters()])
    s.detach()
    u.attach(model)
    u.scale(torch.ones(()))
    F.mse_loss(model(x), y).backward()
    assert u.state.exp_hist.sum() == 0  # an unscaled backward is not observed
    u.scale(F.mse_loss(model(x), y)).backward()
    assert u.state.exp_hist.sum() > 0
    u.detach()


# ---------------------------------------------------------------------------- 4. called one by one, many steps
@pytest.mark.parametrize("name", ["layerwise", "underflow_target"])
def test_models_called_one_by_one_leave_nothing_of_a_step_behind(name: str) -> None:
    a, b = two_models()
    both = nn.ModuleList([b, a])  # never called itself
    s = strategies.create(name).attach(both)
    opt = torch.optim.SGD(both.parameters(), lr=1e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    bounds = Boundaries.of(both)
    seen: list[weakref.ref] = []
    for step in range(300):
        opt.zero_grad()
        h = a(x)
        seen.append(weakref.ref(h))
        s.scale(F.mse_loss(b(torch.tanh(h)), y)).backward()
        s.step(opt)
        s.update()
        assert len(bounds.trace.calls) == 2  # this step's calls only
        del h
    gc.collect()
    assert sum(r() is not None for r in seen) == 0  # every step's activations (and graph) are freed
    s.detach()


# ---------------------------------------------------------------------------- 5. ResNet
def conv3x3(i: int, o: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(i, o, 3, stride, 1, bias=False)


class Residual(nn.Module):
    """The tail both torchvision blocks share: ``out += identity`` (``downsample(x)`` when the
    shape changes), then the in-place ReLU."""

    downsample: nn.Module | None
    relu: nn.Module

    def add_identity(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class BasicBlock(Residual):
    """torchvision.models.resnet.BasicBlock."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv3x3(inplanes, planes, stride), nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.add_identity(x, self.bn2(self.conv2(out)))


class Bottleneck(Residual):
    """torchvision.models.resnet.Bottleneck."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv3x3(planes, planes, stride), nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.add_identity(x, self.bn3(self.conv3(out)))


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet, re-stated (torchvision is not installable beside the CPU
    torch here): conv1-bn1-relu(inplace)-maxpool, four stages of blocks, avgpool, fc."""

    def __init__(self, block: type, layers: list[int], width: int = 8, num_classes: int = 5) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], 2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], 2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)

    def _make_layer(self, block: type, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        out = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        out += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(block: type, seed: int = 0) -> ResNet:
    torch.manual_seed(seed)
    return ResNet(block, [2, 2, 2, 2] if block is BasicBlock else [1, 1, 1, 1])


@pytest.mark.parametrize("block", [BasicBlock, Bottleneck])
@pytest.mark.parametrize("kw", LAYERWISE)
def test_layerwise_trains_a_torchvision_resnet_with_gradscaler_gradients(block: type, kw: dict) -> None:
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 3])
    loss_of = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    model = resnet(block)
    want = gradscaler_step(copy.deepcopy(model), loss_of)
    s = strategies.create("layerwise", **kw).attach(model)  # default groups: residuals inside the stages
    assert s.group_names == ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc"]
    set_scales(s, [2.0**k for k in (14, 3, 20, 8, 11, 16, 10)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(loss_of(model)).backward()
    s.unscale_(opt)
    assert_equal([p.grad for p in model.parameters()], want)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # and it trains: steps taken, scales moving
    s.update()
    for _ in range(3):
        opt.zero_grad()
        s.scale(loss_of(model)).backward()
        s.step(opt)
        s.update()
    assert s.telemetry()["skipped_steps"] == 0


def test_underflow_target_trains_a_resnet_with_gradscaler_gradients() -> None:
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 3])
    loss_of = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    model = resnet(BasicBlock)
    want = gradscaler_step(copy.deepcopy(model), loss_of)
    s = strategies.create("underflow_target", init_scale=2.0**10).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(loss_of(model)).backward()
    s.unscale_(opt)
    assert_equal([p.grad for p in model.parameters()], want)
    assert s.state.exp_hist.sum() > 0
    s.detach()


def test_a_group_split_inside_a_residual_block_is_refused_naming_the_fix() -> None:
    model = resnet(BasicBlock)
    s = strategies.create("layerwise", groups=["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2",
                                                "layer1.0.bn2", "layer1.1", "layer[234]", "fc"]).attach(model)
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"skip connection across a group boundary.*groups=\[\.\.\.\]"):
        model(torch.randn(2, 3, 32, 32))
