"""The default layers (:func:`strategies.model_layers.layers`) follow the repeated blocks: modules
on the way to a ModuleList of blocks are opened, each block is one layer, the modules before and
after it are layers of their own; scalelab's own models and torchvision-style nets keep theirs.
On the HuggingFace models themselves: test_layerwise_hf.py."""

from __future__ import annotations

import torch
from torch import nn

from experiments.workloads.models import CNN, GPT, MLP
from strategies.model_layers import block_list, layers

W = 8


class Block(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.attn = nn.Linear(W, W)
        self.experts = nn.ModuleList([nn.Linear(W, W) for _ in range(experts)]) if experts else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attn(h))
        return h + sum(e(h) for e in self.experts) if self.experts is not None else h


class Body(nn.Module):
    """HF's ``GPT2Model``: embeddings, a ModuleList ``h`` of blocks, a final norm, no parameter of its own."""

    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(16, W), nn.Embedding(8, W)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList([Block(experts), Block(experts)])
        self.ln_f = nn.LayerNorm(W)


class LM(nn.Module):
    """HF's ``GPT2LMHeadModel``: ``transformer`` (the body) and ``lm_head``."""

    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.transformer = Body(experts)
        self.lm_head = nn.Linear(W, 16)


def test_the_modules_on_the_way_to_the_blocks_are_opened_and_each_block_is_a_layer() -> None:
    assert layers(LM()) == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                            "transformer.ln_f", "lm_head"]


def test_a_block_is_never_opened_a_mixture_of_experts_block_included() -> None:
    model = LM(experts=3)
    assert block_list(model.transformer.h[0].experts)  # a block list, but inside a block
    assert layers(model) == layers(LM())


def test_a_list_of_mixed_classes_is_not_a_block_list() -> None:
    """T5's ``block.N.layer`` (self-attention, then feed-forward) are parts of one block."""
    model = nn.Sequential(nn.Linear(W, W))
    model.add_module("mixed", nn.ModuleList([nn.Linear(W, W), nn.LayerNorm(W)]))
    wrapped = nn.Module()
    wrapped.add_module("inner", model)
    assert not block_list(model.mixed) and layers(wrapped) == ["inner"]


def test_a_module_owning_a_parameter_itself_stays_one_layer() -> None:
    """ViT's embeddings hold ``cls_token``: opening such a module would leave it in no layer."""
    body = Body()
    body.register_parameter("cls_token", nn.Parameter(torch.zeros(W)))
    model = nn.Module()
    model.add_module("body", body)
    model.add_module("head", nn.Linear(W, 2))
    assert layers(model) == ["body", "head"]


def test_scalelab_models_and_sequential_stages_keep_their_layers() -> None:
    gpt = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)
    assert layers(gpt) == ["embed", "blocks.0", "blocks.1", "ln_f", "head"]
    gpt.boundaries = None  # found: the ModuleList of blocks is a top-level container
    assert layers(gpt) == ["embed", "blocks.0", "blocks.1", "ln_f", "head"]
    for model in (MLP(in_features=4, num_classes=2, width=8, depth=3), CNN(in_channels=1, num_classes=3, width=4)):
        declared = list(model.boundaries)
        model.boundaries = None
        assert layers(model) == declared
    stages = nn.Sequential(nn.Sequential(nn.Linear(W, W), nn.Linear(W, W)), nn.Linear(W, 2))
    assert layers(stages) == ["0", "1"]  # nn.Sequential is called as one module: one layer
