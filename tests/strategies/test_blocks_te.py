"""strategies.blocks against TransformerEngine's FP8-blockwise and NVFP4 rules restated in plain
Python (tests/strategies/block_oracles.py), bit for bit: values, block scales, the tensor scale
and the dequantised tensor, on random, adversarial and real gradient tensors, row-wise and
column-wise, fp32 and bf16 inputs, nearest and stochastic rounding, with and without the RHT."""

from __future__ import annotations

import pytest
import scipy.linalg
import torch

from strategies.block_math import rht, rht_signs
from strategies.block_recipes import FP8Blockwise, NVFP4
from strategies.blocks import quantize
from tests.strategies import block_oracles as te
from tests.strategies.block_cases import all_inputs, assert_same_bits

INPUTS = all_inputs()
CASES = sorted(INPUTS)
FORMATS = {"e4m3": te.E4M3, "e5m2": te.E5M2}


def _input(name: str, dtype: torch.dtype, columnwise: bool) -> tuple[torch.Tensor, int]:
    """The named input in ``dtype``; column-wise casts run along dim 0 (the oracle then reads
    the transpose row by row)."""
    x = INPUTS[name].to(dtype)
    return x, (0 if columnwise else -1)


def _oracle_rows(x: torch.Tensor, dim: int) -> list[list[float]]:
    """The matrix the oracle walks row by row: ``x`` for dim -1, ``x^T`` for dim 0 (fp32 values)."""
    m = x.float() if dim == -1 else x.float().t()
    return m.tolist()


def _back(rows: list[list[float]], dim: int) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float32)
    return t if dim == -1 else t.t()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block_dims,columnwise", [(1, False), (1, True), (2, False)])
def test_fp8_blockwise_matches_te_formula(case, dtype, elem, pow2, block_dims, columnwise) -> None:
    x, dim = _input(case, dtype, columnwise)
    recipe = FP8Blockwise(elem=elem, pow2_scales=pow2, block_dims=block_dims)
    q = quantize(x, recipe, dim=dim)
    rows = _oracle_rows(x, dim)
    bm = 128 if block_dims == 2 else 1
    values, scale_inv, dq = te.te_blockwise(rows, FORMATS[elem], bm, 128, pow2, 0.0, torch.finfo(dtype).max)
    assert_same_bits(q.values, _back(values, dim), "values")
    assert_same_bits(q.dequantized, _back(dq, dim).to(dtype), "dequantized")
    assert_same_bits(q.scales.transpose(0, 1) if dim == 0 else q.scales,
                     torch.tensor(scale_inv).reshape(q.scales.shape[::-1] if dim == 0 else q.scales.shape),
                     "scale_inv")


def test_fp8_blockwise_amax_epsilon_matches_te() -> None:
    x = INPUTS["subnormal"]
    q = quantize(x, FP8Blockwise(amax_epsilon=1e-30, pow2_scales=False), dim=-1)
    _, scale_inv, dq = te.te_blockwise(x.tolist(), te.E4M3, 1, 128, False, 1e-30, te.FLT_MAX)
    assert_same_bits(q.dequantized, torch.tensor(dq), "dequantized")
    assert_same_bits(q.scales.reshape(-1), torch.tensor(scale_inv), "scale_inv")


def _uniforms(x: torch.Tensor, dim: int, two_d: bool, seed: int) -> list[list[float]]:
    """The uniforms quantize draws (``torch.rand`` of the blocked, zero-padded shape, one call),
    mapped to the elements of the oracle's matrix: block (i, j), slot s = element (r, c)."""
    m = x if dim == -1 else x.t()
    rows, cols = m.shape
    rp, cp = -(-rows // 16) * 16, -(-cols // 16) * 16
    g = torch.Generator().manual_seed(seed)
    if two_d:
        u = torch.rand(rp // 16, cp // 16, 256, generator=g)
        return [[float(u[r // 16, c // 16, (r % 16) * 16 + c % 16]) for c in range(cols)] for r in range(rows)]
    u = torch.rand(rows, cp // 16, 16, generator=g).reshape(rows, cp)
    return u[:, :cols].tolist()


NVFP4_CASTS = [(r, cw) for r in (NVFP4(), NVFP4(rounding="stochastic"), NVFP4(rht=True),
                                  NVFP4(rht=True, rounding="stochastic")) for cw in (False, True)]
NVFP4_CASTS += [(NVFP4(block_dims=2), False), (NVFP4(block_dims=2, rounding="stochastic"), False)]
"""(recipe, column-wise): 2-D tiles are the same tiles column-wise, so they run once."""


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe,columnwise", NVFP4_CASTS,
                         ids=[f"{r.block_dims}d-{r.rounding}-rht{int(r.rht)}-{'col' if c else 'row'}" for r, c in NVFP4_CASTS])
def test_nvfp4_matches_te_formula(case, dtype, recipe, columnwise) -> None:
    x, dim = _input(case, dtype, columnwise)
    if recipe.rht and x.shape[dim] % 16:
        with pytest.raises(ValueError, match=r"x.shape\[dim\] must be a multiple of 16 with rht"):
            quantize(x, recipe, dim=dim)
        return
    gen = torch.Generator().manual_seed(7)
    q = quantize(x, recipe, dim=dim, generator=gen)
    cast = x.float() if dim == -1 else x.float().t()
    if recipe.rht:  # the oracle casts the transformed tensor (the transform itself: test_rht_*)
        cast = rht(cast, rht_signs(recipe.rht_seed))
    u = _uniforms(x, dim, recipe.block_dims == 2, 7) if recipe.rounding == "stochastic" else None
    ref = te.te_nvfp4(cast.tolist(), 16 if recipe.block_dims == 2 else 1, u)
    assert_same_bits(q.values, _back(ref["values"], dim), "values")
    assert_same_bits(q.tensor_scale, torch.tensor(ref["tensor_scale"]), "tensor_scale")
    assert_same_bits(q.scales.transpose(0, 1) if dim == 0 else q.scales,
                     torch.tensor(ref["scales"]).reshape(q.scales.shape[::-1] if dim == 0 else q.scales.shape),
                     "block scales")
    deq = _back(ref["dequantized"], dim)
    if not recipe.rht:
        assert_same_bits(q.dequantized, deq.to(dtype), "dequantized")
    else:  # the inverse transform against H^T in float64 (scipy's Sylvester matrix)
        back, bound = _sylvester(deq if dim == -1 else deq.t(), rht_signs(recipe.rht_seed), inverse=True)
        back, bound = (back, bound) if dim == -1 else (back.t(), bound.t())
        fin = torch.isfinite(back)
        err = (q.dequantized.double() - back.to(dtype).double()).abs()
        assert bool((err <= bound + torch.finfo(dtype).eps * back.abs())[fin].all())


def _sylvester(m: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``m H`` (or ``m H^T``) in float64 with ``H = diag(signs) H_16 / 4`` from scipy, and a bound
    on the fp32 error of computing it in 4 butterfly stages: 4 eps_32 times the tile's abs-sum / 4."""
    h = torch.tensor(scipy.linalg.hadamard(16), dtype=torch.float64) * signs.double()[:, None] / 4
    tiles = m.double().reshape(m.shape[0], -1, 16)
    exact = (tiles @ (h.T if inverse else h)).reshape(m.shape)
    bound = tiles.abs().sum(-1, keepdim=True).expand(-1, -1, 16).reshape(m.shape) * torch.finfo(torch.float32).eps
    return exact, bound


@pytest.mark.parametrize("seed", [None, 0, 3])
def test_rht_is_te_transform_to_fp32_rounding(seed) -> None:
    """``rht(x) = x diag(s) H_16 / 4`` (TE ``_apply_rht``), against scipy's Sylvester H in float64."""
    x = INPUTS["random"][:, :192]
    s = rht_signs(seed)
    exact, bound = _sylvester(x, s)
    assert bool(((rht(x, s).double() - exact).abs() <= bound).all())
    if seed is None:
        assert s.tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
