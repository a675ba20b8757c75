"""Unit scaling (Blake, Orr, Luschi, "Unit Scaling: Out-of-the-Box Low-Precision Training",
ICML 2023): the scaled ops and the layers of the unit-scaled GPT (``model.unit_scaled=true``).

Unit scaling puts fixed scale factors *outside* the weights so that, at initialisation, every
weight, activation and activation gradient has standard deviation about 1: then fp16/fp8 values
sit in the middle of their format's range and no loss scale is needed. The one primitive is
:func:`scaled` — ``y = a x`` in the forward pass and ``dL/dx = b dL/dy`` in the backward pass,
``a`` and ``b`` chosen independently. Each op below states its rule and the file of
graphcore-research/unit-scaling it comes from: the ICML-2023-era library, commit ``299e560``
("Revert grad_w 0.75"; ``unit_scaling/scale.py``, ``unit_scaling/functional.py``,
``unit_scaling/_modules.py``), the version whose defaults (``gmean`` constraint, tau 0.01 / 0.5)
the paper's experiments used; the later u-muP library changed them.

**Scale constraints** (paper Sec. 4; library ``unit_scaling/constraints.py``): a forward scale
``a`` and backward scale ``b`` on an edge may differ only where the edge is a *cut edge* of the
graph (removing it disconnects the graph, e.g. a weight, which is a leaf): there a mismatch only
multiplies the whole upstream gradient by a constant. On other edges (an activation that also
feeds a skip connection) ``a != b`` gives wrong gradients, so the library sets both to their
geometric mean ``(a b)^(1/2)`` (``constraint="gmean"``). Weight-gradient scales are always free.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["scaled", "linear", "gelu", "layer_norm", "embedding", "dropout", "attention",
           "residual_split", "residual_add", "cross_entropy", "loss_grad_scale", "check_gpt",
           "UnitLinear", "UnitLayerNorm", "UnitEmbed", "UnitBlock", "gpt_layers",
           "ATTN_TAU", "MLP_TAU", "GELU_OUT", "GELU_GRAD"]

#: Residual weights of the library's ``TransformerLayer`` (``_modules.py``: ``mhsa_tau=0.01``,
#: ``mlp_tau=0.5``; the user guide: "for self-attention layers tau must be dropped to ~0.01").
ATTN_TAU, MLP_TAU = 0.01, 0.5
#: GELU scales "determined empirically, assuming unit scaled input & grad" (``functional.gelu``):
#: output ``0.588^-1``, input gradient ``0.675^-1``.
GELU_OUT, GELU_GRAD = 1 / 0.588, 1 / 0.675


class _Scaled(torch.autograd.Function):
    """``forward: y = fwd_scale * x``; ``backward: dx = bwd_scale * dy`` (library ``scale.py``,
    ``_ScaledGrad``). The result keeps ``x``'s dtype, so an fp16 gradient stays fp16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_scale: float, bwd_scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.bwd_scale = bwd_scale
        return x * fwd_scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad * ctx.bwd_scale, None, None


def scaled(x: torch.Tensor, fwd_scale: float = 1.0, bwd_scale: float = 1.0) -> torch.Tensor:
    """``fwd_scale * x`` forward, gradient multiplied by ``bwd_scale`` backward (see :class:`_Scaled`).
    The library's ``scale_fwd(x, s)`` is ``scaled(x, s, 1)`` and ``scale_bwd(x, s)`` is ``scaled(x, 1, s)``."""
    return _Scaled.apply(x, float(fwd_scale), float(bwd_scale))


def _gmean(*scales: float) -> float:
    return math.prod(scales) ** (1 / len(scales))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           constraint: str | None = "gmean") -> torch.Tensor:
    """Unit-scaled ``x W^T + b`` (library ``functional.linear``). For ``W: [fan_out, fan_in]`` and
    ``batch = x.numel() / fan_in``: output scale ``fan_in^-1/2`` (unit ``x``, unit ``W`` give unit
    ``y``), input-gradient scale ``fan_out^-1/2``, weight- and bias-gradient scale ``batch^-1/2``
    (the weight gradient sums ``batch`` unit products). ``constraint="gmean"`` sets output and
    input-gradient scales to ``(fan_in fan_out)^-1/4`` (a non-cut edge); ``None`` keeps both
    (the readout: its input feeds nothing else)."""
    fan_out, fan_in = weight.shape
    batch = x.numel() // fan_in
    out_scale, grad_scale = fan_in ** -0.5, fan_out ** -0.5
    if constraint == "gmean":
        out_scale = grad_scale = _gmean(out_scale, grad_scale)
    elif constraint is not None:
        raise ValueError(f"constraint must be 'gmean' or None, got {constraint!r}")
    x = scaled(x, 1.0, grad_scale)
    weight = scaled(weight, 1.0, batch ** -0.5)
    bias = None if bias is None else scaled(bias, 1.0, batch ** -0.5)
    return scaled(F.linear(x, weight, bias), out_scale, 1.0)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Unit-scaled GELU (library ``functional.gelu`` with ``gmean``): both scales
    ``(GELU_OUT * GELU_GRAD)^1/2`` ~= 1.59, on the input's gradient and on the output."""
    s = _gmean(GELU_OUT, GELU_GRAD)
    return scaled(F.gelu(scaled(x, 1.0, s)), s, 1.0)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Unit-scaled LayerNorm over the last dimension ``C`` (library ``functional.layer_norm``): the
    output is already unit; the gain and bias gradients (sums over ``x.numel() / C`` positions)
    are scaled by ``(C / x.numel())^1/2``."""
    c = x.shape[-1]
    s = (c / x.numel()) ** 0.5
    return F.layer_norm(x, (c,), scaled(weight, 1.0, s), scaled(bias, 1.0, s), eps)


def embedding(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Unit-scaled lookup (library ``functional.embedding``): rows of a unit-variance table; the
    table's gradient is scaled by ``(rows / idx.numel())^1/2``."""
    return F.embedding(idx, scaled(weight, 1.0, (weight.shape[0] / idx.numel()) ** 0.5))


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Unit-scaled dropout (library ``functional.dropout``): ``(1-p)^1/2`` on the input's gradient
    and on the output, undoing torch's ``1/(1-p)`` growth of the standard deviation."""
    if p == 0.0 or not training:
        return x
    s = (1 - p) ** 0.5
    return scaled(F.dropout(scaled(x, 1.0, s), p, training), s, 1.0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Unit-scaled causal ``scaled_dot_product_attention`` (library ``functional.
    scaled_dot_product_attention``): with softmax outputs modelled as log-normal, the output of
    attending over ``s`` positions shrinks by ``(s / e)^1/2``, so ``(s (1-p) / e)^1/2`` is applied to
    the output and to the gradients of ``q``, ``k`` and ``v`` ("forward and backward scaling of
    attention are the same")."""
    s = (v.shape[-2] / math.e * (1 - dropout_p)) ** 0.5
    q, k, v = (scaled(t, 1.0, s) for t in (q, k, v))
    return scaled(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p), s, 1.0)


def residual_split(x: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual, skip)`` copies of ``x`` with gradient scales ``tau^1/2`` and ``(1-tau)^1/2``
    (library ``functional.residual_split``): the residual branch's weight is applied to its gradient
    here, at the split, instead of at :func:`residual_add`, so the gradient inside the branch stays
    unit ("delayed" scaling; the product along the branch, hence the gradient, is the same)."""
    return scaled(x, 1.0, tau ** 0.5), scaled(x, 1.0, (1 - tau) ** 0.5)


def residual_add(residual: torch.Tensor, skip: torch.Tensor, tau: float) -> torch.Tensor:
    """``tau^1/2 residual + (1-tau)^1/2 skip`` in the forward pass only (library
    ``functional.residual_add``): unit inputs give a unit sum; with :func:`residual_split` the
    gradient of ``x -> x + f(x)``-style blocks is exact."""
    return scaled(residual, tau ** 0.5, 1.0) + scaled(skip, (1 - tau) ** 0.5, 1.0)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The library's unit-scaled cross-entropy (``functional.cross_entropy``), ``logits: [N, V]``:
    the value is the mean ``-log p_y`` (``scale_fwd(sum, 1/N)``), the gradient of the logits is
    ``(softmax - onehot) V / (V-1)^1/2`` (sum reduction, ``scale_bwd(logits, V/(V-1)^1/2)``): at
    init (``softmax`` ~ uniform) it has unit standard deviation instead of ``~1/(N V^1/2)``."""
    n, v = logits.shape
    loss = F.cross_entropy(scaled(logits, 1.0, v / (v - 1) ** 0.5), target, reduction="sum")
    return scaled(loss, 1.0 / n, 1.0)


def loss_grad_scale(logits: torch.Tensor) -> torch.Tensor:
    """The logits, in fp32, with the gradient multiplier that turns scalelab's loss (the mean
    cross-entropy over ``N = logits.numel() / V`` positions, ``experiments/app/recipe.py``) into
    :func:`cross_entropy`: ``N V / (V-1)^1/2``. Applied after the cast to fp32 so the mean's tiny
    ``1/N`` gradient is undone before it reaches fp16 (the library never forms it: sum reduction)."""
    v = logits.shape[-1]
    n = logits.numel() // v
    return scaled(logits.float(), 1.0, n * v / (v - 1) ** 0.5)


class UnitLinear(nn.Linear):
    """``nn.Linear`` with unit-variance weights (``N(0, 1)``, zero bias; library ``_modules.Linear``)
    and the forward of :func:`linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 constraint: str | None = "gmean") -> None:
        super().__init__(in_features, out_features, bias)
        self.constraint = constraint

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.constraint)


class UnitLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (gain 1, bias 0) with the gradient scales of :func:`layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class UnitEmbed(nn.Module):
    """Token plus position embedding, both tables ``N(0, 1)``, each looked up with
    :func:`embedding` (position ids expanded to ``[B, T]``), summed as ``(tok + pos) / 2^1/2``
    with the same ``2^-1/2`` on both gradients (exact: a weighted sum of two leaves)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        return scaled(embedding(idx, self.tok.weight) + embedding(pos, self.pos.weight), 2 ** -0.5, 2 ** -0.5)


class UnitBlock(nn.Module):
    """Unit-scaled pre-LN block (library ``_modules.TransformerLayer``): ``residual_split`` ->
    LayerNorm -> qkv -> causal :func:`attention` -> proj -> ``residual_add`` (tau
    :data:`ATTN_TAU`), then the same around LayerNorm -> fc -> :func:`gelu` -> fc_out (tau
    :data:`MLP_TAU`). Linears use the ``gmean`` constraint. Same parameter names as
    :class:`experiments.workloads.models.Block`."""

    def __init__(self, n_embd: int, n_head: int, dropout_p: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout_p
        self.ln1, self.ln2 = UnitLayerNorm(n_embd), UnitLayerNorm(n_embd)
        self.qkv = UnitLinear(n_embd, 3 * n_embd)
        self.proj = UnitLinear(n_embd, n_embd)
        self.fc = UnitLinear(n_embd, 4 * n_embd)
        self.fc_out = UnitLinear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        p = self.dropout if self.training else 0.0
        res, skip = residual_split(x, ATTN_TAU)
        q, k, v = self.qkv(self.ln1(res)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = attention(q, k, v, p).transpose(1, 2).contiguous().view(B, T, C)
        x = residual_add(dropout(self.proj(y), p, self.training), skip, ATTN_TAU)
        res, skip = residual_split(x, MLP_TAU)
        h = self.fc_out(gelu(self.fc(self.ln2(res))))
        return residual_add(dropout(h, p, self.training), skip, MLP_TAU)


def check_gpt(qk_norm: bool, attention: str, ffn_gain: float) -> None:
    """The unit-scaled GPT has the standard layout only: refuse the failure-workload options."""
    if qk_norm or attention != "sdpa" or ffn_gain != 1.0:
        raise ValueError("model.unit_scaled=true supports only qk_norm=false, attention=sdpa, ffn_gain=1.0, "
                         f"got qk_norm={qk_norm}, attention={attention!r}, ffn_gain={ffn_gain}")


def gpt_layers(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
               dropout_p: float) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """``(embed, blocks, ln_f, head)`` of the unit-scaled GPT, unit-variance initialised. The head
    is the readout (library ``TransformerDecoder``: ``linear(..., constraint=None)``): output
    ``n_embd^-1/2``, input gradient ``vocab_size^-1/2``; :func:`loss_grad_scale` follows it."""
    embed = UnitEmbed(vocab_size, block_size, n_embd)
    blocks = nn.ModuleList(UnitBlock(n_embd, n_head, dropout_p) for _ in range(n_layer))
    return embed, blocks, UnitLayerNorm(n_embd), UnitLinear(n_embd, vocab_size, bias=False, constraint=None)
