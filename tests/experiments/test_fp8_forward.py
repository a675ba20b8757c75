"""The fp8 forward casts (experiments/workloads/fp8_forward.py) and the fp8_hybrid precision, against plain
torch: the cast is ``x.to(float8_e4m3fn).to(x.dtype)`` after scaling, TransformerEngine's scale
rules re-stated in plain Python, and the GEMM's backward with the quantised operands (TE's
``backward_override=None``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from experiments.workloads.fp8 import CastScaler
from experiments.workloads.fp8_forward import LinearCasts
from experiments.workloads.models import GPT
from experiments.workloads.precision import BoundaryHooks, Precision
from strategies.boundaries import Boundaries

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
CONF = Path(__file__).resolve().parents[2] / "conf" / "precision"


def plain_cast(x: torch.Tensor, s: float) -> torch.Tensor:
    """The reference: scale, torch's own cast to E4M3 and back, unscale (float32 throughout)."""
    return (x * s).to(E4M3).to(x.dtype) / s


def te_delayed_scales(amaxes: list[float], history_len: int, margin: int) -> list[float]:
    """TransformerEngine's DelayedScaling (amax_compute_algo="max") in plain Python: the scale of
    step t is fmt_max / max(amax of steps t-history_len .. t-1) / 2^margin; 1 (TE's initial
    scale) while that history holds no positive amax (common/recipe/delayed_scaling.cu)."""
    scales = []
    for t in range(len(amaxes)):
        window = amaxes[max(0, t - history_len):t]
        amax = max(window, default=0.0)
        scales.append(E4M3_MAX / amax / 2.0**margin if amax > 0 else 1.0)
    return scales


def one_linear(scalings: dict[str, str], history_len: int = 1024, margin: int = 0) -> tuple[nn.Sequential, LinearCasts]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    return model, LinearCasts(model, E4M3, scalings, history_len, margin)


def test_current_scaled_linear_equals_the_plain_torch_cast_of_both_operands() -> None:
    model, _ = one_linear({"activation": "current", "weight": "current"})
    lin = model[0]
    x = torch.randn(5, 8) * 3e-3  # far below E4M3's normal range: unscaled it would mostly flush
    y = model(x)
    xq = plain_cast(x, E4M3_MAX / x.abs().max().item())
    wq = plain_cast(lin.weight.detach(), E4M3_MAX / lin.weight.detach().abs().max().item())
    assert torch.equal(y, F.linear(xq, wq, lin.bias))
    assert not torch.equal(xq, x)  # really quantised


def test_none_is_the_plain_cast() -> None:
    model, casts = one_linear({"activation": "none", "weight": "none"})
    x = torch.randn(5, 8)
    assert torch.equal(casts.cast("activation", "0", x), x.to(E4M3).to(x.dtype))


def test_the_gemm_backward_uses_the_quantised_operands_and_the_cast_passes_straight_through() -> None:
    model, _ = one_linear({"activation": "current", "weight": "current"})
    lin = model[0]
    x = (torch.randn(5, 8) * 0.7).requires_grad_()
    dy = torch.randn(5, 4)
    model(x).backward(dy)
    xq = plain_cast(x.detach(), E4M3_MAX / x.detach().abs().max().item())
    wq = plain_cast(lin.weight.detach(), E4M3_MAX / lin.weight.detach().abs().max().item())
    assert torch.allclose(x.grad, dy @ wq, rtol=1e-6, atol=1e-7)  # dgrad = dy W_q
    assert torch.allclose(lin.weight.grad, dy.T @ xq, rtol=1e-6, atol=1e-7)  # wgrad = dy^T x_q
    assert not torch.allclose(x.grad, dy @ lin.weight.detach(), rtol=1e-3)  # not the unquantised W


@pytest.mark.parametrize("history_len,margin", [(1024, 0), (2, 1)])
def test_delayed_scale_uses_exactly_the_previous_steps_amaxes(history_len: int, margin: int) -> None:
    _, casts = one_linear({"activation": "delayed", "weight": "delayed"}, history_len, margin)
    amaxes = [0.5, 4.0, 0.25, 0.1, 0.1, 3.0]
    scales = te_delayed_scales(amaxes, history_len, margin)
    for amax, s in zip(amaxes, scales):
        x = torch.linspace(-amax, amax / 3, 11)
        assert torch.equal(casts.cast("activation", "0", x), plain_cast(x, s))


def test_an_evaluation_forward_adds_nothing_to_the_history() -> None:
    _, casts = one_linear({"activation": "delayed", "weight": "current"})
    casts.cast("activation", "0", torch.full((3,), 2.0))
    with torch.no_grad():
        casts.cast("activation", "0", torch.full((3,), 100.0))  # evaluation: scale used, not recorded
    x = torch.full((3,), 50.0)
    assert torch.equal(casts.cast("activation", "0", x), plain_cast(x, E4M3_MAX / 2.0))


def test_current_never_saturates_delayed_does_after_an_amax_jump() -> None:
    steady, jump = torch.linspace(-1.0, 1.0, 33), torch.linspace(-100.0, 100.0, 33)
    for mode, saturates in (("current", False), ("delayed", True)):
        _, casts = one_linear({"activation": mode, "weight": mode})
        casts.cast("activation", "0", steady)
        q = casts.cast("activation", "0", jump)
        clipped = (q.abs() < jump.abs() * (1 - 2.0**-4)) & (jump.abs() >= 2.0**-6 * 100 / E4M3_MAX)
        assert bool(clipped.any()) == saturates, mode
    assert q.abs().max().item() == pytest.approx(1.0)  # delayed: clipped at the old amax (448 / s)


def test_a_disabled_pass_and_a_removed_caster_leave_the_linear_alone() -> None:
    model, casts = one_linear({"activation": "current", "weight": "current"})
    lin, x = model[0], torch.randn(5, 8)
    plain = F.linear(x, lin.weight, lin.bias)
    assert not torch.equal(model(x), plain)
    with Boundaries.of(model).disabled():  # the fp32 reference passes (fidelity, norm_ratio)
        assert torch.equal(model(x), plain)
    casts.remove()
    assert torch.equal(model(x), plain) and "forward" not in lin.__dict__


def test_record_false_leaves_the_gradient_quantisers_history_alone() -> None:
    cs = CastScaler(E4M3, E4M3_MAX, "delayed")
    cs("a", torch.tensor([1.0]))
    cs("a", torch.tensor([8.0]), record=False)
    assert torch.equal(cs("a", torch.tensor([3.0])), plain_cast(torch.tensor([3.0]), E4M3_MAX / 1.0))


def hybrid(**change: object) -> dict:
    cfg = yaml.safe_load((CONF / "fp8_hybrid.yaml").read_text())
    cfg.update(change)
    return cfg


def test_fp8_hybrid_is_e4m3_forward_e5m2_backward_with_roles() -> None:
    p = Precision.from_config(hybrid())
    assert (p.forward_format, p.grad_format) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert (p.activation_scaling, p.weight_scaling, p.cast_scaling) == ("current",) * 3
    roles = {"activation": "delayed", "weight": "none", "gradient": "delayed"}
    p = Precision.from_config(hybrid(cast_scaling_roles=roles))
    assert (p.activation_scaling, p.weight_scaling, p.cast_scaling) == ("delayed", "none", "delayed")
    for name in ("fp8_e4m3", "fp8_e5m2", "bf16"):  # the existing modes: no forward cast
        p = Precision.from_config(yaml.safe_load((CONF / f"{name}.yaml").read_text()))
        assert p.forward_format is None and p.activation_scaling == p.weight_scaling == "none"


@pytest.mark.parametrize("change,message", [
    ({"cast_scaling_roles": {"activation": "later"}}, "cast_scaling_roles.activation must be one of"),
    ({"cast_scaling_roles": {"bias": "current"}}, "keys among activation, weight, gradient"),
    ({"cast_scaling": "none"}, "disagree"),
    ({"forward_format": "float16"}, "forward_format must be"),
    ({"forward_format": None}, "apply to modes with a forward_format only"),
])
def test_bad_fp8_hybrid_options_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Precision.from_config(hybrid(**change))


def test_the_gpt_trains_a_step_with_every_linear_cast() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    ref = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    ref.load_state_dict(model.state_dict())
    hooks = BoundaryHooks(model, Precision.from_config(hybrid()))
    assert hooks.forward_casts is not None
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    x = torch.randint(0, 16, (4, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(x), ref(x)
    assert set(hooks.forward_casts.scalers["weight"]._history) == set()  # current: no history kept
    assert not torch.equal(out, expected) and torch.allclose(out.float(), expected.float(), atol=0.25)
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with hooks.disabled():
        assert torch.equal(model(x), ref(x))  # the fp32 reference: no cast anywhere
    hooks.remove()
    assert all("forward" not in model.get_submodule(n).__dict__ for n in names)
