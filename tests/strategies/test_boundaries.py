"""The one layer-boundary module: the layers of a model, the fixed order rescale -> quantize ->
observe whatever the order of attaching, ``disabled()``, and hooks that leave with their users."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.boundaries import Boundaries
from strategies.graph_walk import fence
from strategies.model_layers import layers


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_layers_are_declared_boundaries_or_the_children_that_own_parameters() -> None:
    from experiments.workloads.models import GPT

    assert layers(mlp()) == ["0", "2", "3"]  # Tanh owns no parameter
    gpt = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)
    assert layers(gpt) == ["embed", "blocks.0", "blocks.1", "ln_f", "head"]
    gpt.boundaries = None  # not declared: found by looking inside the ModuleList
    assert layers(gpt) == ["embed", "blocks.0", "blocks.1", "ln_f", "head"]


def grads_with(order: list[str], seed: int = 1) -> list[torch.Tensor]:
    """Parameter gradients with a 'quantize' user (round to 1/8) and a 'rescale' user (x4) on
    layer '2', registered in ``order``; the observer records what arrives."""
    model = mlp(seed)
    b = Boundaries.of(model)
    seen: list[torch.Tensor] = []
    users = {
        "rescale": lambda: b.register("rescale", [model[2]], on_grad=lambda t, i, g: g * 4.0),
        "quantize": lambda: b.register("quantize", [model[2]], on_grad=lambda t, i, g: torch.round(g * 8) / 8),
        "observe": lambda: b.register("observe", [model[2]], on_grad=lambda t, i, g: seen.append(g.clone())),
    }
    for name in order:
        users[name]()
    torch.manual_seed(5)
    x = torch.randn(16, 4)
    F.mse_loss(model(x), torch.zeros(16, 1)).backward()
    return [p.grad for p in model.parameters()] + seen


@pytest.mark.parametrize("order", [["quantize", "rescale", "observe"], ["observe", "quantize", "rescale"],
                                   ["rescale", "observe", "quantize"]])
def test_stage_order_is_fixed_whatever_the_order_of_attaching(order: list[str]) -> None:
    ref = grads_with(["rescale", "quantize", "observe"])
    got = grads_with(order)
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_rescale_comes_before_quantize() -> None:
    """quantize(rescale(g)) differs from rescale(quantize(g)) here; the former is what happens."""
    model = mlp(1)
    torch.manual_seed(5)
    x = torch.randn(16, 4)
    out = model[0:3](x)
    g_out = torch.autograd.grad(F.mse_loss(model[3](out), torch.zeros(16, 1)), out)[0]
    expected = torch.round(g_out * 4.0 * 8) / 8
    assert not torch.equal(expected, torch.round(g_out * 8) / 8 * 4.0)
    seen = grads_with(["quantize", "rescale", "observe"])[-1]
    assert torch.equal(seen, expected)


def test_layerwise_and_fp8_hooks_agree_in_either_order() -> None:
    from experiments.workloads.precision import BoundaryHooks, Precision

    fp8 = Precision.from_config({"name": "fp8_e5m2", "autocast": "bfloat16", "grad_format": "float8_e5m2",
                                 "max": 57344.0, "smallest_normal": 2.0**-14})
    results = []
    for first in ("strategy", "precision"):
        model = mlp(3)
        s = strategies.create("layerwise", init_scale=2.0**4)
        if first == "strategy":
            s.attach(model)
            hooks = BoundaryHooks(model, fp8)
        else:
            hooks = BoundaryHooks(model, fp8)
            s.attach(model)
        s.scale(torch.ones(()))
        sd = s.state_dict()
        sd["extra"]["scale"] = [2.0**-3, 2.0**9, 2.0**4]
        s.load_state_dict(sd)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        torch.manual_seed(7)
        x = torch.randn(16, 4)
        s.scale(F.mse_loss(model(x), torch.ones(16, 1))).backward()
        s.unscale_(opt)
        results.append([p.grad.clone() for p in model.parameters()])
        hooks.remove()
        s.detach()
        assert hook_count(model) == 0
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_disabled_runs_no_transform_and_handles_remove_their_hooks() -> None:
    model = mlp(2)
    ref = copy.deepcopy(model)
    b = Boundaries.of(model)
    h1 = b.register("quantize", [model[0], model[2]], on_grad=lambda t, i, g: g * 0.0)
    h2 = b.register("observe", [model[2]], on_grad=lambda t, i, g: None)
    x = torch.randn(8, 4)
    with b.disabled():
        F.mse_loss(model(x), torch.ones(8, 1)).backward()
    F.mse_loss(ref(x), torch.ones(8, 1)).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    h1.remove()
    assert hook_count(model) == 4  # layer 2 (observe: its pre- and post-hook) + the model's pre/post hooks
    h2.remove()
    assert hook_count(model) == 0
    with pytest.raises(ValueError, match="stage must be one of rescale, quantize, observe"):
        b.register("measure", [model[0]])


def test_each_user_is_charged_its_own_callback_time() -> None:
    """Handle.seconds is the host time of that user's callbacks, forward and backward, and nobody
    else's: the loop adds an attached strategy's share to its overhead (Strategy.hook_seconds)."""
    import time

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    b = Boundaries.of(model)
    slow = b.register("observe", [model[0]], on_grad=lambda trace, i, g: time.sleep(0.02),
                      on_call=lambda trace, i: time.sleep(0.01))
    quick = b.register("rescale", [model[0]], on_grad=lambda trace, i, g: None)
    assert slow.seconds == quick.seconds == 0.0
    model(torch.ones(2, 4)).sum().backward()
    assert slow.seconds >= 0.03 and quick.seconds < 0.03  # the sleeps are charged to slow alone
    s = strategies.create("underflow_target").attach(model)
    assert s.hook_seconds == 0.0 and strategies.create("native").hook_seconds == 0.0
    model(torch.ones(2, 4)).sum().backward()
    assert s.hook_seconds > 0.0
    slow.remove(), quick.remove(), s.detach()


class InplaceAfter(torch.nn.Module):
    """torchvision style: ReLU(inplace=True) on the output of a hooked layer, the last one included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.b(self.relu(self.a(x))))


def test_transforms_reach_outputs_modified_in_place_after_the_hooked_layer() -> None:
    """A user's transform (x4 on 'a', x8 on 'b') acts on the gradient of the value the layer
    returned, through a later in-place ReLU, as if the ReLU were not in place."""
    model, ref = InplaceAfter(), InplaceAfter()
    ref.relu = torch.nn.ReLU()
    x = torch.randn(16, 4)
    seen: list[str] = []
    b = Boundaries.of(model)
    h = b.register("rescale", [model.a, model.b], on_grad=lambda t, i, g: (seen.append(str(i)), g * 4.0 * (1 + i))[1])
    model(x).square().sum().backward()
    rb = Boundaries.of(ref)
    h2 = rb.register("rescale", [ref.a, ref.b], on_grad=lambda t, i, g: g * 4.0 * (1 + i))
    ref(x).square().sum().backward()
    assert sorted(seen) == ["0", "1"]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert torch.equal(model.a.weight.grad, ref.a.weight.grad) and model.a.weight.grad.abs().sum() > 0
    h.remove(), h2.remove()


class InplaceInside(torch.nn.Module):
    """The second hooked layer modifies its input (the first layer's returned view) in place
    before using it."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Sequential(torch.nn.ReLU(inplace=inplace), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_an_argument_modified_in_place_inside_the_call_is_walked_again_after_it() -> None:
    """The walk made before a call for ``on_inputs`` is reused for ``on_link`` after it only while
    the argument is unchanged: here the call's in-place ReLU routes the gradient around 'a''s
    returned view, and the walk after the call moves 'a''s transform (x4) onto its producer."""
    got: dict[bool, list[torch.Tensor]] = {}
    links: dict[bool, list[list[int]]] = {}
    for inplace in (True, False):
        model = InplaceInside(inplace)
        below: list[list[int]] = []
        h = Boundaries.of(model).register(
            "rescale", [model.a, model.b], on_grad=lambda t, i, g: g * 4.0 if i == 0 else None,
            on_inputs=lambda m, t, found: None, on_link=lambda t, i, found, leaves: below.append([k for _, k in found]))
        model(torch.linspace(-1, 1, 16).reshape(4, 4)).square().sum().backward()
        got[inplace], links[inplace] = [p.grad for p in model.parameters()], below
        h.remove()
    assert links[True] == links[False] == [[], [0]]
    assert all(torch.equal(p, q) for p, q in zip(got[True], got[False])) and got[True][0].abs().sum() > 0


class Aliased(torch.nn.Module):
    """One Linear at two paths: inside ``outer`` (called there) and at the top (called there too)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.inner = torch.nn.Linear(4, 4)
        self.outer = torch.nn.Sequential(self.inner, torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.outer(x))


def test_a_call_nested_in_a_call_of_the_same_users_modules_is_seen_once() -> None:
    """A user hooking ``inner`` and ``outer`` sees ``outer`` and the top-level ``inner`` call, not the
    ``inner`` call inside ``outer``; a user hooking ``inner`` alone sees both of its calls."""
    model = Aliased()
    b = Boundaries.of(model)
    both: list[int] = []
    alone: list[int] = []
    h1 = b.register("observe", [model.inner, model.outer], on_call=lambda t, i: both.append(id(t.calls[i])))
    h2 = b.register("observe", [model.inner], on_call=lambda t, i: alone.append(id(t.calls[i])))
    model(torch.randn(2, 4))
    assert both == [id(model.outer), id(model.inner)] and alone == [id(model.inner)] * 2
    h1.remove(), h2.remove()


def test_on_inputs_replaces_an_argument_and_walks_stop_at_its_fence() -> None:
    """``on_inputs`` returns a fence for layer 2's input: its hook sees the gradient layer 2 sends
    down, and the walk from layer 2's inputs no longer reaches layer 0."""
    model = mlp(4)
    b = Boundaries.of(model)
    below: list[list[int]] = []
    seen: list[torch.Tensor] = []
    h = b.register("rescale", [model[0], model[2]],
                   on_inputs=lambda m, t, below: fence(t, lambda g: seen.append(g) or g * 2.0) if m is model[2] else None,
                   on_link=lambda t, i, found, leaves: below.append([k for _, k in found]))
    x = torch.randn(8, 4)
    F.mse_loss(model(x), torch.ones(8, 1)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    h.remove()
    model.zero_grad()
    F.mse_loss(model(x), torch.ones(8, 1)).backward()
    assert below == [[], []] and len(seen) == 1  # layer 2 reached nothing past its fence
    assert torch.equal(grads[0], 2 * model[0].weight.grad) and torch.equal(grads[2], model[2].weight.grad)
