"""The fp8 quantiser: per-tensor cast scaling (none / current / delayed, as TransformerEngine) and
nearest / stochastic rounding, against hand-computed values and plain-torch references."""

from __future__ import annotations

import pytest
import torch

from experiments.workloads.fp8 import CastScaler, quantize_dequantize, stochastic_round
from experiments.workloads.precision import BoundaryHooks, Precision
from strategies.formats import FP16_MIN_NORMAL

E4M3 = torch.float8_e4m3fn


def scaled_cast(g: torch.Tensor, amax: float, margin: int = 0) -> torch.Tensor:
    """The reference: fp8(g s) / s with s = fmt_max / amax / 2^margin, in float32 like the device."""
    s = 448.0 / torch.tensor(amax) / 2.0**margin
    return quantize_dequantize(g * s, E4M3) / s


def test_current_scaling_keeps_what_the_plain_cast_flushes() -> None:
    g = torch.tensor([3e-5, -1e-5, 2e-6, 0.0])  # below half e4m3's smallest subnormal (2^-10): all flush
    assert torch.equal(quantize_dequantize(g, E4M3), torch.zeros(4))
    q = CastScaler(E4M3, 448.0, "current")("layer", g)
    assert torch.equal(q, scaled_cast(g, 3e-5))  # s = fmt_max / amax of this tensor
    assert (q[:3] != 0).all() and torch.allclose(q, g, rtol=0.07)


def test_delayed_scaling_uses_the_history_of_earlier_gradients() -> None:
    cs = CastScaler(E4M3, 448.0, "delayed", history_len=2, margin=1)
    g1, g2, g3 = torch.tensor([1e-3, 2e-3]), torch.tensor([5e-4, 1e-4]), torch.tensor([1e-4, 1e-4])
    assert torch.equal(cs("a", g1), quantize_dequantize(g1, E4M3))  # empty history: s = 1
    assert torch.equal(cs("a", g2), scaled_cast(g2, 2e-3, 1))  # amax of g1, one octave of margin
    assert torch.equal(cs("a", g3), scaled_cast(g3, 2e-3, 1))  # history (5e-4, 2e-3): still g1's
    assert torch.equal(cs("a", g3), scaled_cast(g3, 5e-4, 1))  # g1 left the window of 2
    assert torch.equal(cs("b", g3), quantize_dequantize(g3, E4M3))  # per layer


def test_a_non_finite_gradient_passes_through_unscaled() -> None:
    g = torch.tensor([1e-3, float("inf")])
    for mode in ("current", "delayed"):
        q = CastScaler(E4M3, 448.0, mode)("a", g)
        assert q[1] == float("inf") and torch.isfinite(q[0])


def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours() -> None:
    x = 1.0 + 0.3 * 0.125  # between the e4m3 neighbours 1.0 and 1.125
    before = torch.get_rng_state()
    q = stochastic_round(torch.full((40000,), x), E4M3, torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), before)  # its own generator
    assert set(q.unique().tolist()) == {1.0, 1.125}
    assert q.mean().item() == pytest.approx(x, abs=4 * 0.125 * (0.3 * 0.7 / 40000) ** 0.5)
    on_grid = torch.tensor([0.0, 1.0, -2.5, 448.0, 2.0**-9])
    assert torch.equal(stochastic_round(on_grid, E4M3), on_grid)


def test_precision_options_are_validated() -> None:
    base = {"name": "fp8_e4m3", "autocast": "bfloat16", "grad_format": "float8_e4m3fn",
            "max": 448.0, "smallest_normal": 2.0**-6}
    assert Precision.from_config({**base, "cast_scaling": "delayed", "margin": 2}).margin == 2
    with pytest.raises(ValueError, match="precision.cast_scaling must be one of none, current, delayed, got 'max'"):
        Precision.from_config({**base, "cast_scaling": "max"})
    with pytest.raises(ValueError, match="precision.history_len must be an integer >= 1, got 0"):
        Precision.from_config({**base, "history_len": 0})
    with pytest.raises(ValueError, match="apply to the fp8 modes only, not to fp16"):
        Precision.from_config({"name": "fp16", "autocast": "float16", "max": 65504.0,
                               "smallest_normal": FP16_MIN_NORMAL, "rounding": "stochastic"})


def test_current_scaling_lowers_underflow_at_the_layer_boundaries() -> None:
    """A chain of linear layers whose activation gradients sit below e4m3's range: without cast
    scaling they reach the layers below as zeros; with current scaling they do not."""
    fracs = {}
    for mode in ("none", "current"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        prec = Precision.from_config({"name": "fp8_e4m3", "autocast": "bfloat16", "grad_format": "float8_e4m3fn",
                                      "max": 448.0, "smallest_normal": 2.0**-6, "cast_scaling": mode})
        hooks = BoundaryHooks(model, prec)
        hooks.measure = True
        (model(torch.randn(4, 8)).sum() * 1e-6).backward()
        fracs[mode] = sum(hooks.read()["act_zero_frac"].values())
        hooks.remove()
    assert fracs["none"] > 0.5 and fracs["current"] == 0.0
