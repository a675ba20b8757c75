"""`layerwise`'s arguments and its pure per-group update rule (the attribution table)."""

from __future__ import annotations

import pytest
import torch

import strategies


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rule="ema"), "rule must be one of 'max_ema', 'backoff_growth', 'adaloss', got 'ema'"),
        (dict(groups="0"), "groups must be a list of fnmatch patterns (strings) or None, got '0'"),
        (dict(min_scale=5.0, max_scale=7.0), "max_scale must be a bound leaving a power of two in [min_scale=5, max_scale], got 7.0"),
        (dict(target_max=1e6), "target_max must be <= format_max (65504), got 1000000.0"),
    ],
)
def test_invalid_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("layerwise", **kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("init,low", [(1000.0, 512.0), (3.0, 2.0), (1e38, 2.0**126), (0.3, 0.25)])
@pytest.mark.parametrize("rule", ["max_ema", "backoff_growth", "adaloss"])
def test_an_init_scale_that_is_not_a_power_of_two_is_refused(rule, init, low) -> None:
    """Issue 29: ``init_scale=3.0`` was accepted and became 2 (one warning, lost in a sweep's log,
    while the record said 3.0): a ValueError now names the field and the powers of two around it."""
    with pytest.raises(ValueError) as e:
        strategies.create("layerwise", rule=rule, init_scale=init)
    assert str(e.value) == (f"init_scale must be a power of two, e.g. {low!r} or {2 * low!r} (group scales are "
                            f"powers of two so that boundary rescaling is exact), got {init!r}")
    assert strategies.create("layerwise", rule=rule, init_scale=low).get_scale() == low


# ------------------------------------------------------------------ the pure per-group rule
@pytest.mark.parametrize(
    "group_bad,emitted,contaminated,numel,expect_scales,expect_origin",
    [
        # clean step, rule backoff_growth with interval 1: every group with gradients grows
        ([0, 0, 0], [0, 0, 0], [0, 0, 0], [4, 4, 4], [16, 16, 16], [0, 0, 0]),
        # group 1 emitted a non-finite gradient into group 0 (contaminated): only 1 backs off
        ([1, 0, 0], [0, 1, 0], [1, 0, 0], [4, 4, 4], [8, 4, 8], [0, 1, 0]),
        # group 2's own gradients overflowed, nothing crossed a boundary
        ([0, 0, 1], [0, 0, 0], [0, 0, 0], [4, 4, 4], [8, 8, 4], [0, 0, 1]),
        # a chain: 2 emitted into 1, which passed it on into 0; 2 is the origin
        ([1, 1, 0], [0, 1, 1], [1, 1, 0], [4, 4, 4], [8, 8, 4], [0, 0, 1]),
        # non-finite but nobody qualifies (a path the hooks do not see): everybody backs off
        ([1, 1, 1], [0, 0, 0], [1, 1, 1], [4, 4, 4], [4, 4, 4], [1, 1, 1]),
        # group 1 got no gradient this step: it keeps its scale
        ([0, 0, 0], [0, 0, 0], [0, 0, 0], [4, 0, 4], [16, 8, 16], [0, 0, 0]),
    ],
)
def test_layerwise_update_attribution_table(group_bad, emitted, contaminated, numel, expect_scales, expect_origin) -> None:
    from strategies.rules.layerwise import layerwise_update_

    G = 3
    f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    scales = f([8.0] * G)
    trackers = torch.zeros(G, dtype=torch.int32)
    origin = torch.zeros(G)
    layerwise_update_(
        scales, trackers, torch.zeros(G), torch.zeros(G, dtype=torch.int32), torch.ones(G, dtype=torch.int32),
        torch.zeros(G), origin, torch.tensor(float(any(group_bad))), f(group_bad), f([1.0] * G),
        torch.tensor(numel), f(emitted), f(contaminated),
        "backoff_growth", 32768.0, 0.99, 2.0, 0.5, 1, True, None, None,
    )
    assert scales.tolist() == expect_scales
    assert origin.tolist() == expect_origin
    if any(group_bad):
        assert trackers.tolist() == [0] * G
