"""Properties of the block quantiser (strategies.blocks): values on the element grid, dequantised
values on grid x scale, FLOOR never rounds a scale up, CEIL/RCEIL never clip, stochastic
rounding unbiased and deterministic for a generator, the RHT orthogonal, the layout (dims,
padding, 2-D tiles), the statistics, validation, no host sync, and the modules' size rules.
The bit-exact oracles are in test_blocks_torchao.py (MX) and test_blocks_te.py (TE's rules)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from strategies import block_math, block_recipes, blocks
from strategies.block_math import rht, rht_inverse, rht_signs, round_stochastic
from strategies.block_recipes import ELEMENTS, MX, NVFP4, FP8Blockwise
from strategies.blocks import SCALE_EXP_MIN, block_stats, quantize
from tests.helpers import forbid_host_sync
from tests.strategies.block_cases import adversarial, all_inputs, assert_same_bits, mlp_gradients, random_matrix

INPUTS = all_inputs()
FINITE = {k: v for k, v in INPUTS.items() if bool(torch.isfinite(v).all())}
RECIPES = ([MX(elem=e, scale_rounding=m) for e in ELEMENTS for m in block_recipes.SCALE_ROUNDINGS]
           + [FP8Blockwise(elem=e, pow2_scales=p, block_dims=d) for e in ("e4m3", "e5m2") for p in (True, False)
              for d in (1, 2)]
           + [NVFP4(), NVFP4(block_dims=2), NVFP4(rounding="stochastic"), NVFP4(rht=True)])
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def on_grid(v: torch.Tensor, elem: str) -> torch.Tensor:
    """``v`` is a value of the element format (torch's own float8 casts; the E2M1 table)."""
    if elem == "e2m1":
        return (v.abs().unsqueeze(-1) == E2M1_GRID).any(-1)
    return v.to(TORCH_FP8[elem]).float() == v


def expand(per_block: torch.Tensor, q: blocks.BlockQuantized, shape: torch.Size) -> torch.Tensor:
    """A per-block tensor broadcast to the elements (1-D blocks along ``q.dim`` or 2-D tiles)."""
    k = q.recipe.block_size
    t = per_block.repeat_interleave(k, q.dim)
    if q.recipe.block_shape[0] > 1:
        t = t.repeat_interleave(k, q.dim - 1)
    return t[tuple(slice(0, n) for n in shape)]


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_values_on_grid_and_dequantized_on_grid_times_scale(recipe) -> None:
    for name, x in FINITE.items():
        if getattr(recipe, "rht", False) and x.shape[-1] % 16:
            continue
        q = quantize(x, recipe, dim=-1, generator=torch.Generator().manual_seed(0))
        elem = recipe.element
        assert bool(on_grid(q.values, elem.name).all()) and float(q.values.abs().max()) <= elem.max, name
        if isinstance(recipe, NVFP4):
            if not recipe.rht:  # decode (s_b * A) / 2688 ~ s_b * tensor_scale to an ulp; TE's product
                d = expand(q.scales, q, x.shape) * q.tensor_scale  # s_b * A overflows for A > FLT_MAX / 448
                fin = torch.isfinite(q.dequantized)
                torch.testing.assert_close(q.dequantized[fin], (q.values * d)[fin], rtol=4e-7, atol=0)
            continue
        s = expand(q.scales, q, x.shape)
        assert_same_bits(q.dequantized, q.values * s, f"{name}: dequantized == values * scales")
        normal = (q.dequantized.abs() >= 2.0**-126) & torch.isfinite(q.dequantized)  # FLT_MAX may round to inf
        if isinstance(recipe, MX) or recipe.pow2_scales:
            back = q.dequantized / s
            assert bool(on_grid(back, elem.name)[normal].all()), name


@pytest.mark.parametrize("elem", sorted(ELEMENTS))
def test_floor_never_rounds_the_scale_up_and_clips_exactly_the_large_mantissas(elem) -> None:
    """FLOOR: ``X * 2^p <= amax < X * 2^(p+1)``; a block clips iff ``amax / 2^floor(log2 amax)``
    exceeds ``max / 2^p`` (1.75 for FP8, 1.5 for FP4). CEIL and EVEN never give a smaller scale."""
    e = ELEMENTS[elem]
    for name, x in FINITE.items():
        q = quantize(x, MX(elem=elem, scale_rounding="floor"))
        normal = (q.amax >= 2.0 ** (-126 + e.max_pow2)) & (q.amax <= torch.finfo(torch.float32).max)
        lo, hi = q.scales * 2.0**e.max_pow2, q.scales * 2.0 ** (e.max_pow2 + 1)
        assert bool(((lo <= q.amax) & (q.amax < hi))[normal].all()), name
        m, _ = torch.frexp(q.amax)
        clips = (2 * m > e.max / 2.0**e.max_pow2) & normal
        assert torch.equal((q.scaled_amax > e.max)[normal], clips[normal]), name
        midpoint, tie_up = {"e2m1": (7.0, True), "e4m3": (464.0, False), "e5m2": (61440.0, True)}[elem]
        error = (q.scaled_amax > midpoint) | ((q.scaled_amax == midpoint) & tie_up)
        stats = block_stats(q)
        assert float(stats["clip_error_share"]) == pytest.approx(float((error & normal).sum()) / q.amax.numel(), abs=1e-7)
        assert float(stats["clipped_share"]) == pytest.approx(float(clips.sum()) / q.amax.numel(), abs=1e-7)
        for mode in ("ceil", "even"):
            assert bool((quantize(x, MX(elem=elem, scale_rounding=mode)).scales >= q.scales).all()), (name, mode)


@pytest.mark.parametrize("recipe", [MX(elem=e, scale_rounding=m) for e in ELEMENTS for m in ("ceil", "rceil")]
                         + [FP8Blockwise(), FP8Blockwise(block_dims=2)], ids=repr)
def test_ceil_rceil_and_pow2_blockwise_never_clip(recipe) -> None:
    for name, x in FINITE.items():
        q = quantize(x, recipe)
        assert bool((q.scaled_amax <= recipe.element.max).all()), name
        assert float(block_stats(q)["clipped_share"]) == 0.0, name


def grid(elem: str) -> torch.Tensor:
    """Every finite value of the format, sorted: torch's float8 bit patterns, the E2M1 table."""
    if elem == "e2m1":
        g = E2M1_GRID
    else:
        g = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[elem]).float()
        g = g[torch.isfinite(g)]
    return torch.unique(torch.cat([g, -g]))


@pytest.mark.parametrize("elem", sorted(ELEMENTS))
def test_round_stochastic_is_unbiased(elem) -> None:
    """Each draw is one of the two grid neighbours ``lo <= v <= hi``; the mean of n draws is within
    6 standard errors of ``v`` for each of 512 values, the standard error from the exact Bernoulli
    variance ``p (1 - p) (hi - lo)^2 / n``, ``p = (v - lo) / (hi - lo)``."""
    e = ELEMENTS[elem]
    g = torch.Generator().manual_seed(1)
    v = (torch.rand(512, generator=g) * 2 - 1) * e.max * torch.exp2(-torch.randint(0, 6, (512,), generator=g).float())
    table = grid(elem)
    hi = table[torch.searchsorted(table, v)]
    lo = table[torch.searchsorted(table, v, right=True) - 1]
    n = 2000
    draws = torch.stack([round_stochastic(v, e, g) for _ in range(n)])
    assert bool(((draws == lo) | (draws == hi)).all())
    gap = torch.where(hi > lo, hi - lo, torch.ones_like(v))
    p = (v - lo) / gap
    se = torch.sqrt(p * (1 - p) / n) * gap
    assert bool(((draws.mean(0) - v).abs() <= 6 * se + 1e-6 * v.abs()).all())


def test_nvfp4_stochastic_rounding_is_unbiased_and_deterministic() -> None:
    """Mean of the dequantised tensor over n casts approaches x (bias below the scale rounding's
    few fp32 ulp); nearest rounding stays biased on the same data. Same seed, same bits."""
    x = random_matrix(8, 64, seed=3)
    recipe = NVFP4(rounding="stochastic")
    g = torch.Generator().manual_seed(5)
    n = 3000
    mean = sum(quantize(x, recipe, generator=g).dequantized for _ in range(n)) / n
    q = quantize(x, NVFP4())
    decode = expand(q.scales, q, x.shape) * q.tensor_scale
    tol = 6 * decode / math.sqrt(n)  # one draw's error is below the widest E2M1 spacing, 2 decode
    kept = x.abs() <= 6 * decode * (1 - 1e-6)  # elements past 6 * decode are clipped (E4M3 rounded s_b down)
    assert bool(((mean - x).abs() <= tol + 1e-6 * x.abs())[kept].all())
    assert float(((q.dequantized - x).abs() > tol)[kept].float().mean()) > 0.3
    a = quantize(x, recipe, generator=torch.Generator().manual_seed(9))
    b = quantize(x, recipe, generator=torch.Generator().manual_seed(9))
    c = quantize(x, recipe, generator=torch.Generator().manual_seed(10))
    assert_same_bits(a.values, b.values, "same seed")
    assert not torch.equal(a.values, c.values)


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_rht_is_orthogonal(seed) -> None:
    s = rht_signs(seed)
    h = rht(torch.eye(16), s)
    assert torch.equal(h @ h.T, torch.eye(16)) and torch.equal(h.abs(), torch.full((16, 16), 0.25))
    x = random_matrix(16, 256, seed=2)
    bound = 8 * torch.finfo(torch.float32).eps * x.abs().reshape(16, -1, 16).sum(-1).repeat_interleave(16, -1)
    assert bool(((rht_inverse(rht(x, s), s) - x).abs() <= bound).all())
    torch.testing.assert_close(rht(x, s).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    q, plain = quantize(x, NVFP4(rht=True, rht_seed=seed)), quantize(x, NVFP4())
    rel = lambda d: float((d - x).norm() / x.norm())  # noqa: E731
    assert rel(q.dequantized) < 0.2 and rel(plain.dequantized) < 0.2


def test_layout_dims_padding_and_tiles() -> None:
    x = random_matrix(40, 200)
    for recipe in (MX(), FP8Blockwise(), NVFP4()):
        col, row_t = quantize(x, recipe, dim=0), quantize(x.t().contiguous(), recipe, dim=-1)
        assert_same_bits(col.dequantized, row_t.dequantized.t(), f"{recipe} column-wise")
        assert_same_bits(col.scales, row_t.scales.t(), f"{recipe} column-wise scales")
        pad = quantize(torch.nn.functional.pad(x, (0, 56)), recipe)
        assert_same_bits(quantize(x, recipe).dequantized, pad.dequantized[:, :200], f"{recipe} zero padding")
    x3 = torch.randn(3, 40, 70)
    q = quantize(x3, MX(), dim=1)
    assert q.scales.shape == (3, 2, 70) and q.values.shape == x3.shape
    assert_same_bits(q.dequantized, quantize(x3.transpose(1, 2), MX()).dequantized.transpose(1, 2), "3-d")
    t = quantize(x3, NVFP4(block_dims=2), dim=-2)
    assert t.scales.shape == (3, 3, 5) and t.dim == 2
    assert_same_bits(t.dequantized, quantize(x3, NVFP4(block_dims=2)).dequantized, "2-d tiles either dim")
    h = quantize(x3.half(), MX())
    assert h.dequantized.dtype == torch.float16 and torch.equal(h.values, quantize(x3.half().float(), MX()).values)


def test_block_stats() -> None:
    x = torch.ones(4, 64)
    x[0, 1:32] = 1e-6  # e4m3 floor scale 2^-8: 1e-6 / 2^-8 < 2^-10 flushes
    x[1, 0] = 1.9  # floor: 1.9 / 2^-8 > 448 clips
    x[2, :32] = 0.0
    x[3, 40] = float("nan")
    q = quantize(x, MX())
    s = block_stats(q)
    assert float(s["blocks"]) == 8 and float(s["clipped_share"]) == 1 / 8 and float(s["nonfinite_share"]) == 1 / 8
    assert float(s["clip_error_share"]) == 1 / 8  # 1.9 * 256 = 486.4 rounds to 480 > 448
    assert float(s["flushed_share"]) == pytest.approx(31 / float(q.nonzero.sum()), rel=1e-6)
    hist = s["scale_exp_hist"]
    assert int(hist.sum()) == 7 and int(hist[-8 - SCALE_EXP_MIN]) == 6 and int(hist[-127 - SCALE_EXP_MIN]) == 1
    assert float(block_stats(quantize(torch.zeros(2, 32), NVFP4()))["zero_scale_share"]) == 1.0
    for name, x in INPUTS.items():
        for recipe in (MX(), FP8Blockwise(pow2_scales=False), NVFP4()):
            s = block_stats(quantize(x, recipe))
            ok = (torch.isfinite(quantize(x, recipe).scales) & (quantize(x, recipe).scales > 0)).sum()
            assert int(s["scale_exp_hist"].sum()) == int(ok), (name, recipe)


def test_no_host_sync() -> None:
    """quantize and block_stats never read a tensor on the host (CPU stand-in for a GPU sync)."""
    xs = [mlp_gradients()["a.grad"], adversarial()["nan"]]
    with forbid_host_sync():
        for x in xs:
            for recipe in (MX(scale_rounding="rceil"), FP8Blockwise(block_dims=2), NVFP4(rht=True, rounding="stochastic")):
                block_stats(quantize(x, recipe, generator=torch.Generator().manual_seed(0)))


def test_nonfinite_behaviour() -> None:
    x = torch.ones(2, 32)
    x[0, 3], x[1, 4] = float("nan"), float("inf")
    q = quantize(x, MX())
    assert bool(q.dequantized[0].isnan().all()) and q.dequantized[1, 4] == float("inf")
    assert bool((q.dequantized[1, :4] == 0).all())
    b = quantize(x, FP8Blockwise())  # TE's kernel: scale 1, an inf saturates to 448
    assert b.dequantized[1, 4] == 448.0 and b.amax[1, 0] == float("inf")
    n = quantize(x, NVFP4())
    assert not bool(torch.isfinite(n.dequantized).any())


@pytest.mark.parametrize("make,message", [
    (lambda: MX(block_size=7), "block_size must be one of 16, 32, 64, 128, got 7"),
    (lambda: MX(block_size=True), "block_size must be one of 16, 32, 64, 128, got True"),
    (lambda: MX(scale_rounding="up"), "scale_rounding must be one of 'floor', 'ceil', 'even', 'rceil', got 'up'"),
    (lambda: MX(elem="e3m4"), "elem must be one of 'e4m3', 'e5m2', 'e2m1', got 'e3m4'"),
    (lambda: FP8Blockwise(elem="e2m1"), "elem must be one of 'e4m3', 'e5m2', got 'e2m1'"),
    (lambda: FP8Blockwise(block_dims=3), "block_dims must be one of 1, 2, got 3"),
    (lambda: FP8Blockwise(amax_epsilon=-1.0), "amax_epsilon must be in [0, inf), got -1.0"),
    (lambda: NVFP4(rounding="up"), "rounding must be one of 'nearest', 'stochastic', got 'up'"),
    (lambda: NVFP4(rht=True, block_dims=2), "rht needs block_dims=1 (TE applies it to 1-D blocks only), got 2"),
    (lambda: NVFP4(rht_seed=-1), "rht_seed must be an integer >= 0, got -1"),
    (lambda: quantize(torch.ones(4, dtype=torch.float64), MX()), "x.dtype must be float32, bfloat16 or float16"),
    (lambda: quantize(torch.ones(4), MX(), dim=1), "dim must be in [-1, 0] for a 1-d tensor, got 1"),
    (lambda: quantize(torch.ones(2, 3, 4), NVFP4(block_dims=2), dim=0), "dim must be one of the last two dims"),
    (lambda: quantize(torch.ones(()), MX()), "x must have at least one dim and one element"),
    (lambda: quantize(torch.ones(4), "mxfp8"), "recipe must be an MX, FP8Blockwise or NVFP4, got str"),
])
def test_validation(make, message) -> None:
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("module", [blocks, block_math, block_recipes], ids=lambda m: m.__name__)
def test_module_shape(module) -> None:
    """``__all__`` naming only what exists, no function over 80 lines, the file under 400 lines."""
    path = Path(module.__file__)
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)
    text = path.read_text()
    assert len(text.splitlines()) < 400
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}:{node.name}"
