"""The plain-torch statistics pass against definitions computed element by element in float64."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.formats import FP16_MIN_NORMAL
from strategies.stats import (GradStats, extremes, nonfinite, unscale_and_stats, unscale_and_stats_reference,
                              zeros_and_subnormals)


def definition(grads, inv, groups, G):
    """Statistics straight from their definitions, in float64 on copies."""
    out = {k: [0.0] * G for k in ("found_inf", "absmax", "sumsq", "zeros", "subnormals", "numel")}
    for g, gi in zip(grads, groups):
        x = g.detach().double().flatten()
        u = (g.float() * inv[gi]).to(g.dtype).double().flatten()
        out["found_inf"][gi] = max(out["found_inf"][gi], float(not torch.isfinite(x).all()))
        if u.numel():
            out["absmax"][gi] = max(out["absmax"][gi], u.abs().max().item())
        out["sumsq"][gi] += (u * u).sum().item()
        out["zeros"][gi] += int((x == 0).sum())
        out["subnormals"][gi] += int(((x != 0) & (x.abs() < FP16_MIN_NORMAL)).sum())
        out["numel"][gi] += x.numel()
    return out


def make_grads(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    shapes = [(0,), (1,), (7,), (33, 5), (128,)]
    grads = []
    for shape in shapes:
        t = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-7, 3, shape, generator=g)
        if t.numel() > 3:
            t.view(-1)[0] = 0.0
            t.view(-1)[1] = 2.0**-20
        grads.append(t.to(dtype))
    grads.append(torch.randn(6, 4, generator=g).to(dtype).t())  # non-contiguous
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G", [1, 3])
def test_reference_matches_definitions(dtype: torch.dtype, G: int) -> None:
    grads = make_grads(0, dtype)
    groups = [i % G for i in range(len(grads))]
    inv = torch.tensor([2.0**-k for k in range(3, 3 + G)], dtype=torch.float32)
    want = definition(grads, inv, groups, G)
    originals = [g.clone() for g in grads]
    st = unscale_and_stats_reference(grads, inv, groups, G)
    for g, o, gi in zip(grads, originals, groups):
        assert torch.equal(g, (o.float() * inv[gi]).to(dtype))  # unscaled in place, float math
    assert st.found_inf.tolist() == want["found_inf"]
    assert st.zeros.tolist() == want["zeros"] and st.subnormals.tolist() == want["subnormals"]
    assert st.numel.tolist() == want["numel"]
    assert st.absmax.tolist() == pytest.approx(want["absmax"], rel=1e-6)
    assert st.sumsq.tolist() == pytest.approx(want["sumsq"], rel=1e-5)
    tot = st.total()
    assert tot.numel.item() == sum(want["numel"]) and tot.absmax.item() == pytest.approx(max(want["absmax"]), rel=1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_flags_only_its_group(bad: float) -> None:
    grads = [torch.ones(4), torch.ones(4), torch.ones(4)]
    grads[1][2] = bad
    st = unscale_and_stats(grads, torch.tensor([0.5, 0.25, 1.0]), [0, 1, 2], 3)
    assert st.found_inf.tolist() == [0.0, 1.0, 0.0]
    assert torch.equal(grads[0], torch.full((4,), 0.5))
    assert torch.equal(grads[2], torch.ones(4))


def test_counts_are_taken_before_unscaling() -> None:
    # 2^-10 is normal in fp16; unscaled by 2^-10 it would be 2^-20 (subnormal) — it must count as normal.
    g = [torch.tensor([2.0**-10, 0.0, 2.0**-16])]
    st = unscale_and_stats(g, torch.tensor(2.0**-10))
    assert st.zeros.item() == 1 and st.subnormals.item() == 1


def test_combine_and_total() -> None:
    a = unscale_and_stats([torch.tensor([3.0, 0.0])], torch.tensor(1.0))
    b = unscale_and_stats([torch.tensor([-4.0, float("inf")])], torch.tensor(1.0))
    c = a.combine(b)
    assert c.found_inf.item() == 1.0 and c.zeros.item() == 1 and c.numel.item() == 4
    e = GradStats.empty(2, "cpu")
    assert e.total().numel.shape == (1,)


def test_bad_group_arguments() -> None:
    with pytest.raises(ValueError, match="group_index"):
        unscale_and_stats([torch.ones(2)], torch.tensor(1.0), [0, 0], 1)
    with pytest.raises(ValueError, match="group_index entries"):
        unscale_and_stats([torch.ones(2)], torch.tensor(1.0), [2], 2)
    with pytest.raises(ValueError, match="inv_scale"):
        unscale_and_stats([torch.ones(2)], torch.ones(3), [0], 2)


def test_float64_gradients_are_supported() -> None:
    """GradScaler unscales float64 gradients; so must the statistics pass."""
    g = [torch.tensor([3.0, -4.0, 0.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float16)]
    st = unscale_and_stats(g, torch.tensor(0.5))
    assert st.sumsq.item() == pytest.approx(1.5**2 + 2.0**2 + 0.5**2)
    assert st.absmax.item() == 2.0 and st.zeros.item() == 1
    assert torch.equal(g[0], torch.tensor([1.5, -2.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype,threshold", [(torch.float16, FP16_MIN_NORMAL), (torch.bfloat16, FP16_MIN_NORMAL),
                                             (torch.float32, 2.0**-6), (torch.float32, 2.0**-126)])
def test_zero_and_subnormal_counts_by_hand(dtype, threshold) -> None:
    """Hand-counted: zeros (``-0.0`` included) and nonzero entries below the threshold; NaN and
    Inf in neither; the threshold itself is not below it."""
    a = torch.tensor([0.0, -0.0, float("nan"), float("inf"), threshold, -threshold / 2, threshold / 4, 1.0], dtype=dtype)
    b = torch.tensor([[0.0, 3.0], [-threshold * 0.75, 0.0]], dtype=dtype)
    zeros, subnormals = zeros_and_subnormals([a, b], threshold)
    assert zeros.dtype == subnormals.dtype == torch.int64
    assert (zeros.item(), subnormals.item()) == (4, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_of_extremes_equals_isfinite_any(dtype) -> None:
    """The boundary check (one min/max read) says what ``(~torch.isfinite(g)).any()`` says, on
    the format's extreme finite values too (where a sum or a difference in the format overflows)."""
    big = torch.finfo(dtype).max
    cases = [[1.0, -2.0], [big, -big], [big, big], [-big, -big], [0.0], [math.inf, 1.0], [-math.inf, 1.0],
             [math.inf, -math.inf], [math.nan, 1.0], [math.inf, math.inf], [-math.inf], [math.nan]]
    gen = torch.Generator().manual_seed(3)
    for values in cases:
        g = torch.cat([torch.randn(1000, generator=gen), torch.tensor(values)]).to(dtype)
        g = g[torch.randperm(g.numel(), generator=gen)].reshape(1, -1)
        want = float((~torch.isfinite(g)).any())
        ext = extremes(g)
        assert nonfinite(ext).item() == want, values
        if want == 0.0:  # and the extremes are the entries' own
            assert ext.tolist() == [g.min().double().item(), g.max().double().item()]
    assert nonfinite(extremes(torch.empty(0, dtype=dtype))).item() == 0.0
    rows = torch.stack([extremes(torch.tensor(v)) for v in ([1.0], [math.nan], [2.0, math.inf])])
    assert nonfinite(rows).tolist() == [0.0, 1.0, 1.0]  # one verdict per row
