"""bfloat16 gradients on CUDA bypass torch's unscale op (no bf16 CUDA kernel, pytorch issue
127176): the manual path in strategies/stats.py, forced on the CPU here, must equal torch's CPU
op bit for bit, and the routing must send exactly the bf16 gradients of those devices to it."""

from __future__ import annotations

import pytest
import torch

from strategies import stats
from strategies.stats import unscale_and_check, unscale_and_stats_reference
from tests.cuda.gradients import assert_bits_equal, make_grads

SIZES = [0, 1, 7, 1000, 4099]
LAYOUTS = ("contiguous", "strided", "column_major")
SPECIALS = [(), ("zero", "-zero", "fp16_min_sub", "fp32_sub", "big", "huge"), ("inf",), ("-inf", "nan"), ("nan",)]


@pytest.fixture
def forced(monkeypatch):
    """Route CPU bf16 gradients through the manual path; record what torch's op still receives."""
    seen: list[torch.dtype] = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def spy(grads, found_inf, inv_scale):
        seen.extend(g.dtype for g in grads)
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(stats, "_MANUAL_BF16_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", spy)
    return seen


@pytest.mark.parametrize("specials", SPECIALS, ids=lambda s: "+".join(s) or "plain")
@pytest.mark.parametrize("inv_value", [2.0**-7 * 1.375, 1.0, 3.0, 1e-30, 1e30, 0.0, float("inf"), -0.5])
def test_manual_path_equals_torch_cpu_op(forced, specials, inv_value):
    a = make_grads(SIZES, torch.bfloat16, seed=21, specials=specials, layouts=LAYOUTS)
    b = make_grads(SIZES, torch.bfloat16, seed=21, specials=specials, layouts=LAYOUTS)
    strides = [g.stride() for g in a]
    found_a, found_b = torch.zeros(1), torch.zeros(1)
    unscale_and_check(a, torch.tensor(inv_value), found_a)
    assert forced == [], "a bf16 gradient reached torch's op: the manual path was not taken"
    torch._amp_foreach_non_finite_check_and_unscale_(b, found_b, torch.tensor(inv_value))
    for x, y in zip(a, b):
        assert_bits_equal(x, y)
    assert torch.equal(found_a, found_b)
    assert [g.stride() for g in a] == strides
    assert found_a.item() == (1.0 if {"inf", "-inf", "nan"} & set(specials) else 0.0)


def test_found_inf_is_only_ever_set(forced):
    """As torch's op: a clean list leaves a raised flag raised (several optimizers share it)."""
    g = make_grads([100], torch.bfloat16, seed=22)
    found = torch.ones(1)
    unscale_and_check(g, torch.tensor(0.5), found)
    assert found.item() == 1.0


def test_routing_mixed_list(forced):
    """In one list, float32/float16 gradients still go to torch's op, bf16 ones (forced device) not."""
    grads = [*make_grads([50], torch.float32, seed=23), *make_grads([60], torch.bfloat16, seed=24, specials=("inf",)),
             *make_grads([70], torch.float16, seed=25)]
    ref = [g.clone() for g in grads]
    found, found_ref = torch.zeros(1), torch.zeros(1)
    unscale_and_check(grads, torch.tensor(0.25), found)
    assert forced == [torch.float32, torch.float16]
    torch._amp_foreach_non_finite_check_and_unscale_(ref, found_ref, torch.tensor(0.25))
    for x, y in zip(grads, ref):
        assert_bits_equal(x, y)
    assert found.item() == found_ref.item() == 1.0


def test_cpu_bf16_uses_torch_op_unless_forced():
    """Without forcing, CPU bf16 gradients keep torch's own op (it has a bf16 CPU kernel)."""
    assert stats._MANUAL_BF16_DEVICES == ("cuda",)


@pytest.mark.parametrize("specials", [(), ("nan", "zero"), ("inf", "fp16_min_sub")], ids=lambda s: "+".join(s) or "plain")
def test_reference_stats_unchanged_by_the_manual_path(monkeypatch, specials):
    """unscale_and_stats_reference through the manual path gives the same statistics and bits."""
    sizes, groups = [7, 1000, 0, 4099, 33], [0, 1, 1, 0, 2]
    inv = torch.tensor([2.0**-3 * 1.375, 1.0, 3.0])
    a = make_grads(sizes, torch.bfloat16, seed=26, specials=specials, layouts=LAYOUTS)
    b = make_grads(sizes, torch.bfloat16, seed=26, specials=specials, layouts=LAYOUTS)
    want = unscale_and_stats_reference(b, inv, groups, 3)
    monkeypatch.setattr(stats, "_MANUAL_BF16_DEVICES", ("cuda", "cpu"))
    got = unscale_and_stats_reference(a, inv, groups, 3)
    for x, y in zip(a, b):
        assert_bits_equal(x, y)
    for f in ("found_inf", "absmax", "sumsq", "zeros", "subnormals", "numel"):
        torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=0, atol=0, equal_nan=True, msg=f)
