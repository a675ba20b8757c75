"""`layerwise` never mis-scales silently: tied weights across groups are merged (one warning) and a
skip connection across a group boundary is refused (one error); with the groups fixed, the
unscaled gradients equal torch.amp.GradScaler's bit for bit at very different group scales."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import strategies


def tied_gpt() -> torch.nn.Module:
    from experiments.workloads.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model.head.weight = model.embed.tok.weight  # nanoGPT / GPT-2 weight tying
    return model


class LongSkip(torch.nn.Module):
    """a -> b -> c -> head, with a's output also fed to c (past b)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c, self.head = (torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
                                             torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h)) + h)))


def set_scales(s, scales: list[float]) -> None:
    sd = s.state_dict()
    sd["extra"]["scale"] = scales
    s.load_state_dict(sd)


def gradscaler_grads(model: torch.nn.Module, x: torch.Tensor, loss_fn) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(ref.parameters(), lr=0.0)
    scaler.scale(loss_fn(ref(x))).backward()
    scaler.unscale_(opt)
    return [p.grad for p in ref.parameters()]


def layerwise_grads(s, model: torch.nn.Module, x: torch.Tensor, loss_fn, scales: list[float]) -> list[torch.Tensor]:
    s.scale(torch.ones(()))
    set_scales(s, scales)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s.scale(loss_fn(model(x))).backward()
    s.unscale_(opt)
    return [p.grad for p in model.parameters()]


def test_tied_embedding_and_head_are_merged_into_one_group() -> None:
    model = tied_gpt()
    x = torch.randint(0, 16, (2, 8))
    loss_fn = lambda o: F.cross_entropy(o.reshape(-1, 16), torch.randint(0, 16, (16,), generator=torch.Generator().manual_seed(3)))  # noqa: E731
    want = gradscaler_grads(model, x, loss_fn)
    with pytest.warns(UserWarning, match=r"\['embed.tok.weight = head.weight'\] are shared between groups.*\['embed\+head'\]"):
        s = strategies.create("layerwise").attach(model)
    assert s.group_names == ["embed+head", "blocks.0", "blocks.1", "ln_f"]
    got = layerwise_grads(s, model, x, loss_fn, [2.0**10, 2.0**14, 2.0**20, 2.0**12])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_skip_connection_across_groups_is_refused_with_one_error() -> None:
    model = LongSkip()
    s = strategies.create("layerwise").attach(model)
    assert s.group_names == ["a", "b", "c", "head"]
    s.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"output of group 'a' is also consumed by group 'c', past group 'b'"):
        model(torch.randn(3, 4))


def test_a_skip_connection_inside_one_group_is_exact() -> None:
    model = LongSkip()
    x = torch.randn(5, 4)
    loss_fn = lambda o: F.mse_loss(o, torch.ones(5, 1))  # noqa: E731
    want = gradscaler_grads(model, x, loss_fn)
    s = strategies.create("layerwise", groups=["a", "[bc]", "head"]).attach(model)
    got = layerwise_grads(s, model, x, loss_fn, [2.0**10, 2.0**20, 2.0**14])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
