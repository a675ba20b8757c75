"""`layerwise` on the shapes of real encoder-decoders, in plain torch (the HF models themselves:
test_layerwise_hf.py): every module owning a grouped parameter is part of its group (a tied
embedding owned by a module outside every group, transformers 5's T5; one ``nn.Embedding`` at
three paths, transformers 4's), the default groups follow the repeated blocks, and an output
read again by later groups (the encoder's output, read by every decoder block) is exact. Each
is checked against torch.amp.GradScaler bit for bit with the group scales forced apart."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import strategies
from strategies.model_layers import layers

pytestmark = pytest.mark.usefixtures("one_thread")

V, W = 16, 8
IDS = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(4))
TARGET = torch.randint(0, V, (18,), generator=torch.Generator().manual_seed(5))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.poison = False  # backward: an inf in the gradient it sends into ``memory``

    def forward(self, h: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        if memory is not None:  # cross-attention's part: every decoder block reads the encoder's output
            m = torch.tanh(memory)
            if self.poison:
                m.register_hook(lambda g: g * float("inf"))
            h = h + m
        return h + torch.tanh(self.lin(h))


class Stack(nn.Module):
    """T5Stack: an ``embed_tokens`` sharing the model's embedding, a ModuleList of blocks, a norm.
    transformers 5 gives it an ``nn.Embedding`` of its own tied to ``shared`` (``alias=False``);
    transformers 4 registered the ``shared`` module itself (``alias=True``)."""

    def __init__(self, shared: nn.Embedding, alias: bool) -> None:
        super().__init__()
        if alias:
            self.embed_tokens = shared
        else:
            self.embed_tokens = nn.Embedding(V, W)
            self.embed_tokens.weight = shared.weight
        self.block = nn.ModuleList([Block(), Block()])
        self.final_layer_norm = nn.LayerNorm(W)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for b in self.block:
            h = b(h, memory=memory)
        return self.final_layer_norm(h)


class EncDec(nn.Module):
    def __init__(self, alias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(V, W)
        self.encoder, self.decoder = Stack(self.shared, alias), Stack(self.shared, alias)
        self.lm_head = nn.Linear(W, V, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.decoder(ids, memory=self.encoder(ids)))


def token_loss(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(IDS).reshape(-1, V), TARGET)


def gradscaler_grads(model: nn.Module, loss_of=token_loss) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(ref.parameters(), lr=0.0)
    scaler.scale(loss_of(ref)).backward()
    scaler.unscale_(opt)
    return [p.grad for p in ref.parameters()]


def layerwise_grads(s, model: nn.Module, loss_of=token_loss) -> list[torch.Tensor]:
    s.scale(torch.ones(()))
    sd = s.state_dict()
    sd["extra"]["scale"] = [2.0 ** (4 + 5 * (k % 4)) for k in range(s.num_groups)]  # 2^4 ... 2^19
    s.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(loss_of(model)).backward()
    s.unscale_(opt)
    return [p.grad for p in model.parameters()]


def assert_exact(got: list[torch.Tensor], want: list[torch.Tensor], model: nn.Module) -> None:
    names = [n for n, _ in model.named_parameters()]
    bad = {n: float((g - w).norm() / w.norm()) for n, g, w in zip(names, got, want) if not torch.equal(g, w)}
    assert not bad, f"gradients off GradScaler's (relative error): {bad}"


PER_STACK = ["shared", "encoder.block.*", "encoder.final_layer_norm", "decoder.block.*", "decoder.final_layer_norm",
             "lm_head"]


def test_an_owner_outside_every_group_joins_its_parameters_group() -> None:
    """transformers 5's T5: ``encoder.embed_tokens`` owns ``shared.weight`` but matches no pattern;
    its gradient contribution came at the encoder blocks' scale and was unscaled by the head's."""
    model = EncDec()
    want = gradscaler_grads(model)
    with pytest.warns(UserWarning, match=r"encoder\.embed_tokens owns shared\.weight; decoder\.embed_tokens owns "
                                         r"shared\.weight\): each joined that parameter's group"):
        s = strategies.create("layerwise", groups=PER_STACK).attach(model)
    assert s.group_names == ["shared+lm_head", "encoder.block.*", "encoder.final_layer_norm", "decoder.block.*",
                             "decoder.final_layer_norm"]
    assert_exact(layerwise_grads(s, model), want, model)


def test_an_aliased_module_inside_a_group_and_outside_every_group_is_exact() -> None:
    """transformers 4's T5: one ``nn.Embedding`` at ``shared``, ``encoder.embed_tokens`` (inside
    the group ``encoder``) and ``decoder.embed_tokens`` (outside every group). It joins the group
    and its call inside ``encoder`` is nested there: no boundary inside a group."""
    model = EncDec(alias=True)
    want = gradscaler_grads(model)
    with pytest.warns(UserWarning, match=r"shared owns shared\.weight"):
        s = strategies.create("layerwise", groups=["encoder", "decoder.block.*", "decoder.final_layer_norm",
                                                   "lm_head"]).attach(model)
    assert s.group_names == ["encoder+lm_head", "decoder.block.*", "decoder.final_layer_norm"]
    assert_exact(layerwise_grads(s, model), want, model)


@pytest.mark.parametrize("alias", [False, True])
def test_default_groups_are_the_blocks_and_an_output_read_by_every_later_block_is_exact(alias: bool) -> None:
    """Per-block default groups; the encoder's output is read by both decoder blocks (groups of
    their own): the second one's gradient into it is converted at its input."""
    model = EncDec(alias)
    want = gradscaler_grads(model)
    assert layers(model) == ["shared", "encoder.embed_tokens", "encoder.block.0", "encoder.block.1",
                             "encoder.final_layer_norm", "decoder.embed_tokens", "decoder.block.0", "decoder.block.1",
                             "decoder.final_layer_norm", "lm_head"]
    with pytest.warns(UserWarning, match="tied weights"):
        s = strategies.create("layerwise").attach(model)
    assert s.group_names == ["shared+encoder.embed_tokens+decoder.embed_tokens+lm_head", "encoder.block.0",
                             "encoder.block.1", "encoder.final_layer_norm", "decoder.block.0", "decoder.block.1",
                             "decoder.final_layer_norm"]
    assert_exact(layerwise_grads(s, model), want, model)


class Ancestor(nn.Module):
    """A module that owns a parameter tied to the head's and holds a group module below it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inner = nn.Linear(W, W)
        self.proj = nn.Parameter(torch.randn(V, W) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) @ self.proj.t()


class WithAncestor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.mid = Ancestor()
        self.back = nn.Linear(V, W)
        self.head = nn.Linear(W, V, bias=False)
        self.head.weight = self.mid.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.back(torch.tanh(self.mid(torch.tanh(self.first(x)))))))


def test_an_owner_around_another_group_merges_with_it() -> None:
    model = WithAncestor()
    x = torch.randn(4, W, generator=torch.Generator().manual_seed(6))
    y = torch.randn(4, V, generator=torch.Generator().manual_seed(7))
    loss_of = lambda m: F.mse_loss(m(x), y)  # noqa: E731
    want = gradscaler_grads(model, loss_of)
    with pytest.warns(UserWarning, match=r"mid owns mid\.proj"):
        s = strategies.create("layerwise", groups=["first", "mid.inner", "back", "head"]).attach(model)
    assert s.group_names == ["first", "mid.inner+head", "back"]
    assert_exact(layerwise_grads(s, model, loss_of), want, model)


def test_an_overflow_sent_into_an_output_read_again_is_blamed_on_the_group_that_sent_it() -> None:
    """decoder.block.1's gradient into the encoder's output overflows: only its group backs off
    (it emitted the inf; decoder.block.0's scale, which the encoder's output carries, and the
    encoder's groups below are contaminated, not blamed)."""
    model = EncDec()
    model.decoder.block[1].poison = True
    with pytest.warns(UserWarning, match="tied weights"):
        s = strategies.create("layerwise", rule="backoff_growth").attach(model)
    s.scale(torch.ones(()))
    before = s.telemetry()["scales"].clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(token_loss(model)).backward()
    s.step(opt)
    s.update()
    blamed = [n for n, o in zip(s.group_names, s.telemetry()["overflow_origin"].tolist()) if o]
    assert blamed == ["decoder.block.1"]
    assert (s.telemetry()["scales"] / before).tolist() == [1.0 if n not in blamed else 0.5 for n in s.group_names]


class FunctionalHead(nn.Module):
    """Logits from the embedding's weight in the model's own forward (no module owns that use)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(V, W)
        self.block = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(W)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.block:
            h = b(h)
        return F.linear(self.ln_f(h), self.embed.weight)


def test_a_parameter_used_outside_every_module_owning_it_is_refused_naming_it() -> None:
    """Its contribution would come at the loss side's scale and be unscaled by its group's."""
    model = FunctionalHead()
    s = strategies.create("layerwise").attach(model)
    assert s.group_names == ["embed", "block.0", "block.1", "ln_f"]
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"parameter 'embed\.weight' \(group 'embed'\) is used outside the calls of "
                                         r"its group's modules, by ops at group 'ln_f''s scale"):
        s.scale(token_loss(model))
