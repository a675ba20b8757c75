"""The block-scaled precision modes (``precision=mxfp8 | fp8_blockwise | nvfp4``): a Linear's three
GEMMs against a plain-torch re-statement built on the public quantiser, bit for bit on CPU; the
shipped YAMLs; one-line errors for bad knobs; the compare_tiny GPT training under each mode."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from experiments.workloads.block_config import parse_blocks
from experiments.workloads.block_linear import BlockLinears
from experiments.workloads.models import GPT
from experiments.workloads.precision import BoundaryHooks, Precision
from strategies.block_recipes import MX, NVFP4, FP8Blockwise
from strategies.blocks import block_stats, quantize
from tests.experiments.runs import run_tiny

CONF = Path(__file__).resolve().parents[2] / "conf" / "precision"
MODES = ("mxfp8", "fp8_blockwise", "nvfp4")


def mode_cfg(name: str, **blocks: object) -> dict:
    """``conf/precision/<name>.yaml`` as loaded, with ``blocks`` entries replaced."""
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    cfg["blocks"].update(copy.deepcopy(blocks))
    return cfg


def restated(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, rows: dict, cols: dict,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three GEMMs of a block-scaled Linear written out with ``strategies.blocks.quantize``: the
    forward ``Q(x) Q(W)^T + b`` with blocks along in-features, ``dx = Q(dy) Q(W along out)``,
    ``dW = Q'(dy along tokens)^T Q'(x along tokens)``, ``db = sum dy``; stochastic draws from one
    generator seeded ``seed``, in that order (TE's row-/column-wise copies, torchao's ``mx_mm``)."""
    gen = torch.Generator().manual_seed(seed)

    def q(t: torch.Tensor, recipe: object, dim: int) -> torch.Tensor:
        g = gen if getattr(recipe, "rounding", "nearest") == "stochastic" else None
        return quantize(t, recipe, dim=dim, generator=g).dequantized

    y = F.linear(q(x, rows["activation"], -1), q(w, rows["weight"], -1), b)
    dx = q(dy, rows["gradient"], -1) @ q(w, rows["weight"], -2)
    dw = q(dy, cols["gradient"], -2).t() @ q(x, cols["activation"], -2)
    return y, dx, dw, dy.sum(0)


def one_linear(cfg: dict, seed: int = 3) -> tuple[nn.Sequential, BlockLinears]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    return model, BlockLinears(model, parse_blocks(cfg["blocks"]), seed)


@pytest.mark.parametrize("name,change", [
    ("mxfp8", {}),
    ("mxfp8", {"gradient": {"elem": "e5m2", "block_size": 16, "scale_rounding": "rceil", "rounding": "stochastic"}}),
    ("mxfp8", {"activation": {"elem": "e2m1", "block_size": 32, "scale_rounding": "even", "rounding": "nearest"}}),
    ("fp8_blockwise", {}),
    ("fp8_blockwise", {"weight": {"elem": "e4m3", "block_size": 32, "block_dims": 1, "pow2_scales": False,
                                  "amax_epsilon": 0.0, "rounding": "nearest"}}),
    ("nvfp4", {}),
    ("nvfp4", {"weight": {"block_dims": 1, "rounding": "nearest", "rht": False, "rht_seed": None},
               "gradient": {"block_dims": 1, "rounding": "nearest", "rht": False, "rht_seed": None}}),
])
def test_a_linear_matches_the_plain_torch_restatement_bit_for_bit(name: str, change: dict) -> None:
    cfg = mode_cfg(name, keep=[], **change)
    model, casts = one_linear(cfg, seed=3)
    lin = model[0]
    x = (torch.randn(32, 64) * torch.logspace(-6, 2, 64)).requires_grad_()  # a wide range per row
    dy = torch.randn(32, 48) * 1e-3
    y = model(x)
    y.backward(dy)
    spec = casts.spec
    ry, rdx, rdw, rdb = restated(x.detach(), lin.weight.detach(), lin.bias.detach(), dy, spec.rowwise, spec.columnwise, 3)
    assert torch.equal(y, ry) and torch.equal(x.grad, rdx) and torch.equal(lin.weight.grad, rdw)
    assert torch.equal(lin.bias.grad, rdb)
    assert not torch.equal(y, F.linear(x, lin.weight, lin.bias))  # really quantised


def test_under_autocast_the_gemm_is_fp32_and_the_output_bf16() -> None:
    model, casts = one_linear(mode_cfg("mxfp8", keep=[]))
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    rows = casts.spec.rowwise
    ref = F.linear(quantize(x, rows["activation"]).dequantized, quantize(model[0].weight.detach(), rows["weight"]).dequantized,
                   model[0].bias.detach())
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.to(torch.bfloat16))


def test_the_shipped_modes_carry_their_sources_defaults() -> None:
    specs = {n: Precision.from_config(mode_cfg(n)).blocks for n in MODES}
    assert specs["mxfp8"].rowwise["gradient"] == MX()  # OCP MX v1.0: E4M3, k = 32, FLOOR
    assert specs["fp8_blockwise"].rowwise["weight"] == FP8Blockwise(block_dims=2)
    assert specs["fp8_blockwise"].rowwise["activation"] == FP8Blockwise()
    nv = specs["nvfp4"]
    assert nv.rowwise["weight"] == NVFP4(block_dims=2) and nv.rowwise["gradient"] == NVFP4(rounding="stochastic")
    assert nv.columnwise["gradient"] == NVFP4(rounding="stochastic", rht=True) and nv.columnwise["activation"].rht
    assert not nv.rowwise["activation"].rht  # TE: the RHT on the column-wise (wgrad) copies only
    assert all(s.keep == ("head",) for s in specs.values())


@pytest.mark.parametrize("name,change,message", [
    ("mxfp8", {"gradient": {"elem": "e4m3", "block_size": 32, "scale_rounding": "up", "rounding": "nearest"}},
     r"^precision\.blocks\.gradient\.scale_rounding must be one of 'floor', 'ceil', 'even', 'rceil', got 'up'$"),
    ("mxfp8", {"weight": {"block_size": 7}}, r"^precision\.blocks\.weight\.block_size must be one of 16, 32, 64, 128"),
    ("mxfp8", {"activation": {"size": 32}}, r"^precision\.blocks\.activation has no option 'size'; allowed: elem,"),
    ("fp8_blockwise", {"recipe": "mx9"}, r"^precision\.blocks\.recipe must be one of mx, fp8_blockwise, nvfp4"),
    ("nvfp4", {"weight": {"block_dims": 2, "rht": True}}, r"^precision\.blocks\.weight\.rht must be false"),
    ("nvfp4", {"gradient": {"block_dims": 2, "rht": True}}, r"^precision\.blocks\.gradient\.rht needs block_dims=1"),
    ("nvfp4", {"keep": "head"}, r"^precision\.blocks\.keep must be a list"),
])
def test_a_bad_knob_is_one_line_naming_the_option(name: str, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        Precision.from_config(mode_cfg(name, **change))
    assert "\n" not in str(info.value)


def test_blocks_belong_to_the_block_modes_only_and_keep_must_match() -> None:
    with pytest.raises(ValueError, match="precision.blocks is required by mxfp8"):
        Precision.from_config({**mode_cfg("mxfp8"), "blocks": None})
    bf16 = yaml.safe_load((CONF / "bf16.yaml").read_text())
    with pytest.raises(ValueError, match="refused by the other modes"):
        Precision.from_config({**bf16, "blocks": mode_cfg("mxfp8")["blocks"]})
    with pytest.raises(ValueError, match=r"keep pattern 'blocks\.9\.\*' matches no Linear; Linears: 0$"):
        one_linear(mode_cfg("mxfp8", keep=["blocks.9.*"]))


def test_kept_disabled_and_removed_linears_are_plain() -> None:
    model, casts = one_linear(mode_cfg("nvfp4", keep=["0"]))
    x = torch.randn(16, 64)
    assert casts.kept == ["0"] and torch.equal(model(x), F.linear(x, model[0].weight, model[0].bias))
    model, casts = one_linear(mode_cfg("nvfp4", keep=[]))
    plain = F.linear(x, model[0].weight, model[0].bias)
    assert not torch.equal(model(x), plain)
    casts.remove()
    assert torch.equal(model(x), plain)


def test_a_non_finite_gradient_reaches_the_scaler() -> None:
    model, _ = one_linear(mode_cfg("fp8_blockwise", keep=[]))  # TE's kernel would saturate inf to 448
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 48)
    dy[3, 5] = math.inf
    model(x).backward(dy)
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(model[0].weight.grad).all()


@pytest.mark.parametrize("name", MODES)
def test_the_compare_tiny_gpt_trains_under_each_mode(tmp_path: Path, name: str) -> None:
    summary, rows = run_tiny(tmp_path, f"precision={name}", "strategy=native", "train.steps=4", "train.log_every=2",
                             model="gpt")
    train = [r for r in rows if r["kind"] == "train"]
    assert summary["status"] == "completed" and all(math.isfinite(r["loss"]) for r in train)
    assert train[-1]["loss"] < train[0]["loss"] + 0.5
    stats = train[-1]["block_stats"]
    assert "head" not in stats and set(stats) == {"blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.fc_out"}
    assert set(stats["blocks.0.fc"]) == {"activation", "weight", "gradient"}


def test_the_fp32_reference_passes_see_no_cast() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32)
    hooks = BoundaryHooks(model, Precision.from_config(mode_cfg("mxfp8")))
    x = torch.randint(0, 16, (2, 16))
    quantised = model(x)
    with hooks.disabled():
        plain = model(x)
    hooks.remove()
    assert torch.equal(plain, model(x)) and not torch.equal(quantised, plain)


def test_block_telemetry_counts_the_clipped_flushed_and_scale_exponents_of_a_case_built_to_clip() -> None:
    """Rows of two 1 x 32 blocks, each block one max ``1.9 * 2^(r-8)`` and 31 elements of 1e-7: under
    OCP FLOOR (E4M3, max_pow2 8) the scale is ``2^(r-16)``, the max scales to 486.4 > 448 (clipped, and
    it would round to 480 > 464: a clip error), and 1e-7 / 2^(r-16) flushes to zero where it is below 2^-10."""
    x = torch.full((16, 64), 1e-7)
    x[:, 0] = x[:, 32] = 1.9 * torch.exp2(torch.arange(16.0) - 8)
    stats = {}
    for rounding in ("floor", "rceil"):
        opts = {"elem": "e4m3", "block_size": 32, "scale_rounding": rounding, "rounding": "nearest"}
        model, casts = one_linear(mode_cfg("mxfp8", keep=[], activation=opts))
        casts.measuring = lambda: True
        with torch.no_grad():  # the forward's casts only: activation and weight, row-wise
            model(x)
        stats[rounding] = casts.read()["0"]
        casts.reset()
        assert casts.read() == {}
    act = stats["floor"]["activation"]
    assert act["blocks"] == 32 and act["clipped_share"] == act["clip_error_share"] == 1.0
    flushed = sum(62 for r in range(16) if 1e-7 / 2.0 ** (r - 16) < 2.0**-10) / (16 * 64)  # E4M3: below half of 2^-9
    assert act["flushed_share"] == pytest.approx(flushed) and act["zero_scale_share"] == 0.0
    assert act["scale_exp_hist"] == {"lo": -16, "counts": [2] * 16}
    assert stats["rceil"]["activation"]["clipped_share"] == 0.0  # the scale rounded up: 2^(r-15)
    assert stats["rceil"]["activation"]["scale_exp_hist"] == {"lo": -15, "counts": [2] * 16}
    model, _ = one_linear(mode_cfg("mxfp8", keep=[]))
    expected = block_stats(quantize(model[0].weight.detach(), MX()))
    w = stats["floor"]["weight"]
    assert w["blocks"] == 96 and w["clipped_share"] == pytest.approx(float(expected["clipped_share"]))
    assert set(stats["floor"]) == {"activation", "weight"}  # no backward ran
