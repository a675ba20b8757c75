"""`underflow_target`: the placement rule on hand-made histograms, and on a deep narrow fp16 MLP
whose input-side activation gradients underflow at native's scale."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies.formats import FP16_MAX, FP16_MIN_NORMAL
from strategies.stats import E_BINS, E_LO, bin_counts, exponent_histogram, fold_histogram
from strategies.rules.underflow_target import underflow_target_update_


def place(values: list[float], scale: float = 1.0, found: float = 0.0, target: float = 1e-3,
          observed: bool = True) -> float:
    s = torch.tensor(scale)
    hist = exponent_histogram(torch.tensor(values))
    underflow_target_update_(s, hist, torch.tensor(found), target, FP16_MAX, FP16_MIN_NORMAL, 2.0, 0.5, 32, observed)
    assert hist.sum() == 0  # cleared for the next step
    return s.item()


def test_exponent_histogram_counts_nonzero_finite_entries_by_floor_log2() -> None:
    h = exponent_histogram(torch.tensor([1.0, 1.5, 0.25, -3.0, 0.0, math.inf, math.nan]))
    assert h[0 - E_LO] == 2 and h[-2 - E_LO] == 1 and h[1 - E_LO] == 1 and h.sum() == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sync_free", [False, True], ids=["bincount", "scatter_add"])
def test_exponent_histogram_equals_frexp_of_the_selected_entries(dtype, sync_free, monkeypatch) -> None:
    """Both counting paths (CPU bincount; CUDA's sync-free scatter_add_) equal frexp + bincount
    of the nonzero finite entries selected by boolean indexing, subnormals and specials included."""
    gen = torch.Generator().manual_seed(5)
    g = torch.exp2(torch.empty(20000).uniform_(-160, 130, generator=gen)) * torch.randn(20000, generator=gen).sign()
    u = torch.rand(20000, generator=gen)
    g[u < 0.1], g[(u >= 0.1) & (u < 0.12)], g[(u >= 0.12) & (u < 0.14)] = 0.0, math.nan, -math.inf
    g = g.to(dtype)
    x = g.float()[(g.float() != 0) & torch.isfinite(g.float())]
    want = torch.bincount(torch.frexp(x)[1].long() - 1 - E_LO, minlength=E_BINS)
    forced = sync_free
    monkeypatch.setattr("strategies.stats.bin_counts", lambda idx, sync_free: bin_counts(idx, forced))
    assert torch.equal(exponent_histogram(g), want) and want.sum() > 1000


@pytest.mark.parametrize("values,scale,target,expected", [
    # 1000 entries at 2^-20: six octaves below 2^-14 -> S x 2^6
    ([2.0**-20] * 1000, 1.0, 1e-3, 2.0**6),
    # one entry in 1000 may stay below: the single 2^-30 is left, the rest moved to 2^-14
    ([2.0**-30] + [2.0**-20] * 999, 1.0, 1e-3, 2.0**6),
    # with target 0 the smallest entry decides: 2^-30 -> 2^-14 needs 2^16 ...
    ([2.0**-30] + [2.0**-20] * 999, 1.0, 0.0, 2.0**16),
    # ... unless the largest would pass target_max (2^15 exclusive): 2^0 allows at most 2^14
    ([2.0**-30, 1.0] + [2.0**-20] * 998, 1.0, 0.0, 2.0**14),
    # S is the *smallest* power of two meeting the target (most headroom against overflow):
    # entries at 2^16 (S = 2^10) move down 30 octaves, to the smallest normal 2^-14
    ([2.0**16] * 10, 2.0**10, 1e-3, 2.0**-20),
])
def test_placement_by_hand(values, scale, target, expected) -> None:
    assert place(values, scale, target=target) == expected


def test_overflow_safety_wins_over_underflow() -> None:
    """Entries spanning 2^-30 .. 2^14 cannot all be normal and below 2^15: the largest decides."""
    assert place([2.0**-30, 2.0**14] * 10, 1.0, target=0.0) == 1.0


def test_overflow_backs_off_and_all_zero_grows_only_when_observed() -> None:
    assert place([1.0], 8.0, found=1.0) == 4.0
    assert place([0.0, 0.0], 8.0) == 16.0
    assert place([0.0], 8.0, observed=False) == 8.0


def deep_narrow(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[m for _ in range(10) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())],
                               torch.nn.Linear(16, 1))


def input_side_zero_fraction(name: str, steps: int = 12) -> float:
    """fp16 autocast, loss x 1e-8: fraction of exact zeros in the first layer's activation
    gradient over the last steps."""
    model = deep_narrow()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = strategies.create(name).attach(model)
    seen = []

    def watch(module, inputs, output):
        output.register_hook(lambda g: seen.append((g == 0).float().mean().item()))

    model[0].register_forward_hook(watch)
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        s.scale(F.mse_loss(out.float(), y) * 1e-8).backward()
        s.step(opt)
        s.update()
    return sum(seen[-4:]) / 4


def test_lowers_the_input_side_zero_fraction_against_native() -> None:
    native, placed = input_side_zero_fraction("native"), input_side_zero_fraction("underflow_target")
    assert native > 0.5 and placed < 0.05, (native, placed)


@pytest.mark.parametrize("lo,bins", [(-64, 96), (-20, 8)])
def test_folded_histogram_equals_clamped_bincount_of_the_exponents(lo, bins) -> None:
    """The run record's histogram (experiments.workloads.precision: exponents from ``lo``, ``bins`` bins,
    out-of-range exponents clamped into the end bins) is the full one folded: equal to a plain
    frexp + clamp + bincount over the nonzero finite entries."""
    gen = torch.Generator().manual_seed(7)
    g = torch.exp2(torch.empty(5000).uniform_(-150, 120, generator=gen)) * torch.randn(5000, generator=gen).sign()
    g[::17], g[::23] = 0.0, math.inf
    x = g[(g != 0) & torch.isfinite(g)]
    want = torch.bincount((torch.frexp(x)[1].long() - 1 - lo).clamp(0, bins - 1), minlength=bins)
    got = fold_histogram(exponent_histogram(g), lo, bins)
    assert torch.equal(got, want) and int(want[0]) > 0 and int(want[-1]) > 0
