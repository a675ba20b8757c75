"""The doctor's block-clipping measurement: how many blocks of each Linear's GEMM operands a
block-scaled recipe clips on this step (``diagnose(..., blocks={role: recipe})``).

One fp32 forward (autocast off) records every ``nn.Linear``'s input and output; the gradient of the
loss with respect to each output comes from ``torch.autograd.grad`` (no ``.grad`` is written). Each
operand, flattened to ``(tokens, features)`` — ``activation`` (the input), ``weight``, ``gradient``
(of the output) — is cast with the role's recipe along both dims (the row-wise and column-wise
copies of TE and torchao; NVFP4 without the RHT, which needs the token count to be a multiple of 16)
by :func:`strategies.blocks.quantize`, and :func:`strategies.blocks.block_stats` counts the blocks
whose max element saturates (``clipped``) and those where that changes the value
(``clip_error``: it would round above the element max). Block scales do not depend on a
power-of-two loss scale, so the unscaled fp32 gradient stands for the scaled one.

Why it matters: under the OCP MX FLOOR rule (``e = floor(log2 amax) - max_pow2``) a block max with
mantissa above ``elem_max / 2^max_pow2`` saturates (E4M3: above 1.75, about 19% of blocks for a
log-uniform mantissa; E2M1: above 1.5, about 41%): AMD measured ~37% of MXFP4 blocks clipped and
moved to RCEIL (ROCm/aiter PR 3212), and "Recipes for Pre-training LLMs with MXFP8" (arXiv
2506.08027) found FLOOR diverging where rounding the scale up trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from strategies.block_recipes import MX, NVFP4, Recipe
from strategies.blocks import block_stats, quantize

__all__ = ["BLOCK_ROLES", "BlockClip", "measure_block_clipping", "recipe_label", "scale_fix"]

BLOCK_ROLES = ("activation", "weight", "gradient")


@dataclass(frozen=True)
class BlockClip:
    """One Linear's operand in one role: blocks cast (both copies), the share whose max element
    saturated and the share where that changed the value."""

    layer: str
    role: str
    blocks: int
    clipped_share: float
    clip_error_share: float
    recipe: Recipe


def recipe_label(recipe: Recipe) -> str:
    """``FLOOR scale rounding`` (MX), ``the NVFP4 E4M3 block scale``, ``FP8 blockwise scaling``."""
    if isinstance(recipe, MX):
        return f"{recipe.scale_rounding.upper()} scale rounding ({'MXFP4' if recipe.elem == 'e2m1' else 'MXFP8'})"
    return "the NVFP4 E4M3 block scale" if isinstance(recipe, NVFP4) else "FP8 blockwise scaling"


def scale_fix(clip: BlockClip) -> str:
    """What removes the clipping: a scale rounded up (MX), else the layer kept in bf16."""
    if isinstance(clip.recipe, MX) and clip.recipe.scale_rounding in ("floor", "even"):
        return (f"round the block scale up: precision.blocks.{clip.role}.scale_rounding=rceil (TE, cuBLAS) or ceil "
                "(arXiv 2506.08027; ROCm/aiter PR 3212)")
    return f"keep {clip.layer} in bf16 (precision.blocks.keep)"


def _operands(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
              dev: str) -> dict[str, dict[str, torch.Tensor]]:
    """Per Linear (last call): its input, weight and the loss gradient of its output, fp32, 2-d."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor, nn.Linear]] = {}

    def hook(name: str) -> Callable:
        def record(mod: nn.Linear, args: tuple, out: torch.Tensor) -> None:
            seen[name] = (args[0], out, mod)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.autocast(dev, enabled=False), torch.enable_grad():
            loss = loss_fn(model, batch).float()
    finally:
        for h in handles:
            h.remove()
    names = [n for n, (_, out, _) in seen.items() if out.requires_grad]
    grads = torch.autograd.grad(loss, [seen[n][1] for n in names], allow_unused=True) if names else ()
    flat = {}
    for n, g in zip(names, grads):
        x, out, mod = seen[n]
        g = torch.zeros_like(out) if g is None else g
        flat[n] = {"activation": x, "weight": mod.weight, "gradient": g}
    return {n: {r: t.detach().reshape(-1, t.shape[-1]).float() for r, t in ops.items()} for n, ops in flat.items()}


def measure_block_clipping(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
                           recipes: Mapping[str, Recipe], dev: str) -> list[BlockClip]:
    """Every Linear's operands in each role of ``recipes`` (module docstring); one forward and one
    backward (``autograd.grad``) in fp32. The caller keeps the model's state (RNG, ``.grad``)."""
    bad = sorted(set(recipes) - set(BLOCK_ROLES))
    if bad:
        raise ValueError(f"blocks must map roles among {', '.join(BLOCK_ROLES)} to recipes, got {bad[0]!r}")
    out = []
    for layer, ops in _operands(model, loss_fn, batch, dev).items():
        for role, recipe in recipes.items():
            cast = dataclasses.replace(recipe, rht=False) if isinstance(recipe, NVFP4) and recipe.rht else recipe
            stats = [block_stats(quantize(ops[role], cast, dim=d)) for d in (-1, -2)]
            n = sum(float(s["blocks"]) for s in stats)
            clipped = sum(float(s["clipped_share"] * s["blocks"]) for s in stats) / n
            error = sum(float(s["clip_error_share"] * s["blocks"]) for s in stats) / n
            out.append(BlockClip(layer, role, int(n), clipped, error, recipe))
    return out
