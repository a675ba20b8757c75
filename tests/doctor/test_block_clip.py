"""The doctor's block-clipping verdict: the measured clip shares against the OCP MX rules restated in
plain Python on an operand built to clip, the verdict's words, and the RCEIL control."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from experiments.doctor.cli import main
from experiments.doctor.diagnosis import doctor_precision
from experiments.workloads.precision import Precision

from strategies.block_recipes import MX, NVFP4
from strategies.doctor import EXIT_CODES, diagnose
from strategies.doctor.block_clip import measure_block_clipping
from tests.experiments.runs import run_tiny


def mx_clip_shares(t: torch.Tensor, elem_max: float, max_pow2: int, rounding: str) -> tuple[float, float]:
    """(clipped, clip error) shares over the 1 x 32 blocks of both dims of ``t`` under OCP MX v1.0
    section 6.3 (floor: ``e = floor(log2 amax) - max_pow2``) or rceil (``e = ceil(log2(amax /
    elem_max))``): a block clips when ``amax / 2^e > elem_max`` and errs when that would round past
    the max (E2M1: from 7 up, the tie 7 going to 8)."""
    clipped = errs = n = 0
    for rows in (t.tolist(), t.t().tolist()):
        for row in rows:
            for i in range(0, len(row), 32):
                amax = max(abs(v) for v in row[i:i + 32])
                n += 1
                if amax == 0:
                    continue
                e = math.floor(math.log2(amax)) - max_pow2 if rounding == "floor" else math.ceil(math.log2(amax / elem_max))
                scaled = amax / 2.0**e
                clipped += scaled > elem_max
                errs += scaled >= 7.0
    return clipped / n, errs / n


def built_to_clip(seed: int) -> torch.Tensor:
    """A 64 x 64 operand whose elements are ``m * 2^k`` with mantissas ``m`` spread over [1, 2):
    about a quarter of the maxima have ``m >= 1.75`` (E2M1 FLOOR clips those from 7 to 6)."""
    g = torch.Generator().manual_seed(seed)
    m = 1.0 + torch.randint(0, 16, (64, 64), generator=g) / 16.0
    k = torch.randint(-10, 10, (64, 64), generator=g).float()
    sign = torch.where(torch.rand(64, 64, generator=g) < 0.5, -1.0, 1.0)
    return sign * m * torch.exp2(k)


class Probe(nn.Module):
    """One Linear whose output gradient is exactly the constant ``c``: loss = sum(lin(x) * c)."""

    def __init__(self, c: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.c).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_measured_gradient_clipping_is_the_ocp_rule(seed: int, rounding: str) -> None:
    c = built_to_clip(seed)
    model = Probe(c)
    clips = measure_block_clipping(model, lambda mod, b: mod(b), torch.randn(64, 64),
                                   {"gradient": MX(elem="e2m1", scale_rounding=rounding)}, "cpu")
    (clip,) = clips
    expected = mx_clip_shares(c, 6.0, 2, rounding)
    assert (clip.layer, clip.role, clip.blocks) == ("lin", "gradient", 64 * 2 * 2)  # 64 rows x 2 blocks, both dims
    assert (clip.clipped_share, clip.clip_error_share) == pytest.approx(expected, abs=1e-7)
    assert (expected[1] > 0.1) == (rounding == "floor")  # floor clips, rceil never does


def test_the_verdict_names_the_rounding_the_share_the_role_and_the_layer() -> None:
    torch.manual_seed(0)
    c = built_to_clip(0)
    model = Probe(c)
    x = torch.randn(64, 64)
    d = diagnose(model, lambda mod, b: mod(b), x, precision="bf16", compare_strategies=False,
                 blocks={"gradient": MX(elem="e2m1")})
    share = mx_clip_shares(c, 6.0, 2, "floor")[1]
    assert d.cause == "block_clipping" and d.exit_code == EXIT_CODES["block_clipping"] == 9
    assert d.verdict == f"FLOOR scale rounding clips {100 * share:.1f}% of gradient blocks in lin"
    assert "scale_rounding=rceil" in d.fix and d.first_module == "lin"
    control = diagnose(model, lambda mod, b: mod(b), x, precision="bf16", compare_strategies=False,
                       blocks={"gradient": MX(elem="e2m1", scale_rounding="rceil")})
    assert control.cause == "healthy"
    high = diagnose(model, lambda mod, b: mod(b), x, precision="bf16", compare_strategies=False,
                    blocks={"gradient": MX(elem="e2m1")}, block_clip_threshold=min(0.99, share + 0.01))
    assert high.cause == "healthy"


def test_nvfp4_saturates_but_never_changes_a_max_and_bad_roles_are_refused() -> None:
    model = Probe(built_to_clip(1))
    (clip,) = measure_block_clipping(model, lambda mod, b: mod(b), torch.randn(64, 64),
                                     {"weight": NVFP4(rht=False)}, "cpu")
    assert clip.clipped_share > 0 and clip.clip_error_share == 0  # the E4M3 block scale rounds within 6 * 17/16
    with pytest.raises(ValueError, match="blocks must map roles among activation, weight, gradient to recipes, got 'bias'"):
        measure_block_clipping(model, lambda mod, b: mod(b), torch.randn(64, 64), {"bias": MX()}, "cpu")
    with pytest.raises(ValueError, match=r"block_clip_threshold must be in \(0, 1\), got 1.5"):
        diagnose(model, lambda mod, b: mod(b), torch.randn(64, 64), precision="bf16", block_clip_threshold=1.5)


def test_the_app_diagnoses_a_block_run_in_its_autocast_dtype_with_its_row_wise_recipes() -> None:
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "precision" / "mxfp8.yaml").read_text())
    name, blocks = doctor_precision(Precision.from_config(cfg))
    assert name == "bf16" and blocks == {"activation": MX(), "weight": MX(), "gradient": MX()}
    assert doctor_precision("fp16") == ("fp16", None)


def test_scalelab_doctor_on_a_block_scaled_run_measures_its_recipe(tmp_path: Path, capsys) -> None:
    """An MXFP4-FLOOR run directory: diagnosed in bf16 (the mode's autocast) with the recipe's clipping."""
    fp4 = [f"precision.blocks.{r}.elem=e2m1" for r in ("activation", "weight", "gradient")]
    run_tiny(tmp_path / "run", "precision=mxfp8", *fp4, "train.steps=2", "train.checkpoint_every=2",
             "train.log_every=2", "train.eval_every=0", model="gpt")
    code = main([str(tmp_path / "run"), "--json", "--no-strategies"])
    data = json.loads(capsys.readouterr().out)
    assert code == EXIT_CODES["block_clipping"] and data["cause"] == "block_clipping" and data["precision"] == "bf16"
    assert data["verdict"].startswith("FLOOR scale rounding clips ") and "precision.blocks." in data["fix"]
    assert data["passes"] == {"forward": 3, "backward": 3}  # each: fp32, blocks, mixed
