"""The three workloads' models: a character GPT, an MLP and a small CNN.

Every model exposes ``boundaries``: the dotted names of the sub-modules whose *outputs* are the
"layer boundaries" of the precision study. The training loop hooks them (``experiments/
precision.py``) to quantise activation gradients (simulated fp8) and to measure, per layer, the
fraction of the activation gradient that is zero or subnormal. Nothing in the models knows about
precision or scaling.

Stress knobs shared by all three: depth and width, and ``init_scale``, a factor applied to the
standard initialisation of every weight matrix (``init_scale < 1`` shrinks activations and hence
gradients, ``> 1`` grows them). The GPT follows karpathy/nanoGPT (pre-LayerNorm blocks, weight
std 0.02, residual projections scaled by ``1/sqrt(2 n_layer)``).

Failure workloads (the ``scalelab-doctor`` suite and ``conf/model/gpt_*.yaml``), each off by
default so the standard models are unchanged:

* ``GPT(ffn_gain=g)`` multiplies both FFN weight matrices (``fc``, ``fc_out``) by ``g`` at init,
  so the FFN output grows like ``g**2``: with ``g`` large enough it exceeds the fp16 maximum
  65504 in the forward pass, as T5's ``wo`` output does (HF transformers issue #9295, "T5 fp16
  NaN"; their fix keeps ``wo`` in fp32, ``_keep_in_fp32_modules``).
* ``GPT(attention="explicit")`` computes the attention logits ``q k^T / sqrt(d)`` in a module of
  their own (``blocks.i.scores``) instead of the fused ``scaled_dot_product_attention``, so that
  under fp16 autocast they are an fp16 matmul that overflows when the logits grow — the
  attention-logit growth at high learning rate of Wortsman et al. 2023 ("Small-scale proxies
  for large-scale Transformer training instabilities", Sec. 3.1). ``qk_norm=True`` is their fix:
  LayerNorm on the queries and keys (per head) before the dot product.

``GPT(unit_scaled=True)`` is the unit-scaled variant of Blake et al. 2023 (``experiments/
unit_scaling.py``): same layout and parameter names, unit-variance weights, scale factors outside
the weights, and the loss gradient scaled so that activation gradients start at unit scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from experiments.workloads import unit_scaling
from strategies import validation as v

__all__ = ["GPT", "MLP", "CNN"]


def _check(name: str, value: object, check: v.Check) -> None:
    """``check`` (:mod:`strategies.validation`) of the option ``model.<name>``: a one-line ``ValueError`` naming it."""
    check(f"model.{name}", value)


def _scale_init(model: nn.Module, init_scale: float) -> None:
    """Multiply every weight matrix / kernel (dim >= 2) by ``init_scale`` in place."""
    if init_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(init_scale)


class Embed(nn.Module):
    """Token plus learned position embedding: ``x = E_tok[idx] + E_pos[0..T-1]``."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Scores(nn.Module):
    """Causal attention logits ``q k^T / sqrt(d)`` (masked positions ``-inf``), as a module so
    hooks see them: ``[B, H, T, d] x [B, H, T, d] -> [B, H, T, T]``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return att.masked_fill(~mask, float("-inf"))


ATTENTIONS = ("sdpa", "explicit")


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (causal attention).

    ``qk_norm``: LayerNorm over each head's queries and keys (Wortsman et al. 2023);
    ``attention="explicit"``: logits from :class:`Scores`, softmax in fp32, then ``att @ v``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool = False,
                 attention: str = "sdpa") -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        if qk_norm:
            self.q_norm = nn.LayerNorm(n_embd // n_head)
            self.k_norm = nn.LayerNorm(n_embd // n_head)
        self.qk_norm = qk_norm
        if attention == "explicit":
            self.scores = Scores()
        self.attention = attention
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        p = self.dropout if self.training else 0.0
        if self.attention == "explicit":
            att = F.dropout(self.scores(q, k).float().softmax(dim=-1), p, self.training)
            y = att.to(v.dtype) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.dropout(self.proj(y), p, self.training)
        x = x + F.dropout(self.fc_out(F.gelu(self.fc(self.ln2(x)))), p, self.training)
        return x


class GPT(nn.Module):
    """A small GPT-style character language model (nanoGPT layout).

    ``forward(idx)`` maps token ids ``[B, T]`` to logits ``[B, T, vocab_size]``; the loss is the
    mean next-token cross-entropy (computed by the training loop). Boundaries: ``embed``, each
    block ``blocks.i``, and ``head`` (the logits).
    """

    accepts = ("text",)

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        init_scale: float = 1.0,
        qk_norm: bool = False,
        attention: str = "sdpa",
        ffn_gain: float = 1.0,
        unit_scaled: bool = False,
    ) -> None:
        super().__init__()
        _check("vocab_size", vocab_size, v.whole(2))
        _check("block_size", block_size, v.whole(1))
        _check("n_layer", n_layer, v.whole(1))
        _check("n_head", n_head, v.whole(1))
        _check("n_embd", n_embd, v.whole(1))
        _check("dropout", dropout, v.between(0.0, 1.0, "[]"))
        _check("init_scale", init_scale, v.at_least(1e-12))
        _check("ffn_gain", ffn_gain, v.at_least(1e-12))
        if n_embd % n_head:
            raise ValueError(f"model.n_embd must be divisible by model.n_head={n_head}, got {n_embd}")
        _check("attention", attention, v.named(*ATTENTIONS))
        _check("qk_norm", qk_norm, v.flag)
        _check("unit_scaled", unit_scaled, v.flag)
        self.block_size = block_size
        self.unit_scaled = unit_scaled
        if unit_scaled:  # experiments/workloads/unit_scaling.py: unit-variance init, scales outside the weights
            unit_scaling.check_gpt(qk_norm, attention, ffn_gain)
            self.embed, self.blocks, self.ln_f, self.head = unit_scaling.gpt_layers(
                vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        else:
            self.embed = Embed(vocab_size, block_size, n_embd)
            self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, qk_norm, attention) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.head = nn.Linear(n_embd, vocab_size, bias=False)
            self.apply(self._init)
            for name, p in self.named_parameters():
                if name.endswith(("proj.weight", "fc_out.weight")):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
        _scale_init(self, init_scale)
        if ffn_gain != 1.0:
            with torch.no_grad():
                for block in self.blocks:
                    block.fc.weight.mul_(ffn_gain)
                    block.fc_out.weight.mul_(ffn_gain)
        self.boundaries = ["embed", *[f"blocks.{i}" for i in range(n_layer)], "ln_f", "head"]

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds model.block_size={self.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return unit_scaling.loss_grad_scale(logits) if self.unit_scaled else logits


class MLP(nn.Module):
    """``depth`` hidden layers of ``Linear -> activation`` and a linear classifier head.

    Boundaries: each hidden layer's output ``layers.i`` and ``head``.
    """

    accepts = ("vectors", "images")

    def __init__(
        self,
        in_features: int = 32,
        num_classes: int = 10,
        width: int = 128,
        depth: int = 3,
        activation: str = "relu",
        init_scale: float = 1.0,
    ) -> None:
        super().__init__()
        _check("in_features", in_features, v.whole(1))
        _check("num_classes", num_classes, v.whole(2))
        _check("width", width, v.whole(1))
        _check("depth", depth, v.whole(1))
        _check("init_scale", init_scale, v.at_least(1e-12))
        acts = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
        _check("activation", activation, v.named(*acts))
        dims = [in_features] + [width] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), acts[activation]()) for a, b in zip(dims[:-1], dims[1:])
        )
        self.head = nn.Linear(width, num_classes)
        _scale_init(self, init_scale)
        self.boundaries = [f"layers.{i}" for i in range(depth)] + ["head"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CNN(nn.Module):
    """``depth`` blocks of ``Conv3x3 -> ReLU``, every ``pool_every``-th followed by ``MaxPool2``
    (block ``i`` has ``width * 2**(i // pool_every)`` channels), global average pooling and a
    linear head. Boundaries: ``convs.i`` and ``head``.

    ``pool_every=1`` (the default) is one pool per block; ``pool_every=k`` gives VGG-style stages
    of ``k`` convolutions, so a net deeper than ``log2(image_size)`` blocks still fits the image
    (``depth // pool_every`` pools must not exceed ``log2`` of the image side, else the pooling
    raises). No normalisation and PyTorch's default init, so backward signals shrink with depth.
    """

    accepts = ("images",)

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 16,
        depth: int = 2,
        init_scale: float = 1.0,
        pool_every: int = 1,
    ) -> None:
        super().__init__()
        _check("in_channels", in_channels, v.whole(1))
        _check("num_classes", num_classes, v.whole(2))
        _check("width", width, v.whole(1))
        _check("depth", depth, v.whole(1))
        _check("init_scale", init_scale, v.at_least(1e-12))
        _check("pool_every", pool_every, v.whole(1))
        chans = [in_channels] + [width * 2 ** (i // pool_every) for i in range(depth)]
        self.convs = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.ReLU(),
                          *([nn.MaxPool2d(2)] if (i + 1) % pool_every == 0 else []))
            for i, (a, b) in enumerate(zip(chans[:-1], chans[1:]))
        )
        self.head = nn.Linear(chans[-1], num_classes)
        _scale_init(self, init_scale)
        self.boundaries = [f"convs.{i}" for i in range(depth)] + ["head"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = conv(x)
        return self.head(x.mean(dim=(2, 3)))
