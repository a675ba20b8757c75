"""Every strategy under FSDP2 (``fully_shard``, 2 gloo ranks) equals one process on the same
gradients, scale for scale (issue 29): the runs of :mod:`tests.strategies.sharded_runs`.

Both ranks must hold the same scale and telemetry at every step; the scales, the skipped steps,
the abs-max and the counts must be those of the one-process run exactly, the sums of squares
(summed over shards in another order) to float32 rounding, and the parameters (gathered from
the shards) bit for bit. Every rule runs also with ``track_stats=False`` (``-nostats``): the
injected Inf and NaN must skip the step on both ranks and back the scale off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import FIXED_SCALE
from tests.strategies.gloo import run_ranks
from tests.strategies.sharded_runs import CASES, INF_STEP, NAN_STEP, STEPS, WORLD, fsdp2_all, one_process

pytestmark = pytest.mark.distributed

EXACT = ("scale", "found_inf", "skipped_steps", "grad_absmax", "grad_zero_frac", "grad_subnormal_frac", "scales",
         "group_absmax", "group_zero_frac", "growth_tracker", "group_growth_tracker")
CLOSE = ("grad_norm", "norm_ratio", "log_ratio_ema")  # sums of squares in another order: float32 rounding


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(fsdp2_all, tmp_path_factory.mktemp("fsdp2"), WORLD, timeout_s=120.0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize(("cid", "name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_fsdp2_equals_one_process(ranks: list[dict[str, Any]], cid: str, name: str, kw: dict, one_thread) -> None:
    r0, r1 = ranks[0][cid], ranks[1][cid]
    assert not isinstance(r0, str), r0
    assert not isinstance(r1, str), r1
    one = one_process(name, kw)
    for step in range(STEPS):
        a, b, o = r0[step], r1[step], one[step]
        assert a["scale"] == b["scale"] == o["scale"], f"step {step}: scales {a['scale']}, {b['scale']}, one {o['scale']}"
        assert _same(a["params"], b["params"]), f"step {step}: the ranks' parameters differ"
        assert _same(a["params"], o["params"]), f"step {step}: parameters differ from one process"
        ta, tb, to = a["telemetry"], b["telemetry"], o["telemetry"]
        assert ta.keys() == tb.keys() == to.keys()
        for key in ta:
            if key.endswith("_time_s"):
                continue
            assert _same(ta[key], tb[key]), f"step {step}: telemetry {key!r} differs across ranks"
            if key in CLOSE:
                torch.testing.assert_close(ta[key], to[key], rtol=1e-5, atol=1e-6, equal_nan=True,
                                           msg=f"step {step}: {key}")
            else:
                assert _same(ta[key], to[key]), f"step {step}: {key} {ta[key]} vs one process {to[key]}"
        if step in (INF_STEP, NAN_STEP) and kw.get("enabled", True):
            assert ta["found_inf"].item() == 1.0
            before, after = r0[step - 1]["scale"], a["scale"]
            if "scales" not in ta and kw.get("hysteresis", 1) == 1:
                assert after == before if name in FIXED_SCALE else after < before, f"step {step}: {before} -> {after}"
    assert r0[-1]["telemetry"].get("skipped_steps", torch.tensor(2)).item() == 2  # "none" is disabled
