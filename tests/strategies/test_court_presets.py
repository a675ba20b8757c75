"""The court's presets and remedies (``conf/strategy/*.yaml``, issue 30) against their sources' rules
restated in plain Python (``tests/strategies/restated.py``) with the sources' own numbers.

Each YAML is built as the app builds it; overflow sequences (clean runs long enough for the preset's
growth interval to act, between bursts of overflows) drive it through real scale/unscale_/step/
update calls, and its scale after every update must equal the source's exactly (power-of-two
scales and factors 2, 1/2: float32 and Python floats agree bit for bit).
"""

from __future__ import annotations

import random

import pytest

import strategies
from tests.helpers import CONF
from tests.helpers import preset_keywords as keywords
from tests.strategies.drivers import run
from tests.strategies.restated import DeepSpeed, Fairseq, Megatron, Metaseq, Torch, fairseq_trajectory, \
    metaseq_trajectory


def preset(name: str):
    rule, kw = keywords(CONF / "strategy" / f"{name}.yaml")
    return strategies.create(rule, **kw)


def bursts(seed: int, steps: int, longest: int) -> list[int]:
    """Clean runs of up to ``longest`` steps, each followed by a burst of 1-6 steps that overflow
    with probability 0.8, until ``steps`` flags."""
    rng = random.Random(seed)
    flags: list[int] = []
    while len(flags) < steps:
        flags += [0] * rng.randint(longest // 4, longest) + [int(rng.random() < 0.8) for _ in range(rng.randint(1, 6))]
    return flags[:steps]


def updates(ref, flags: list[int]) -> list[float]:
    """``ref.update(found_inf)`` per step (torch, Megatron); the scale after each."""
    out = []
    for f in flags:
        ref.update(bool(f))
        out.append(ref.scale if isinstance(ref, Torch) else ref._scale)
    return out


def deepspeed_run(ref: DeepSpeed, flags: list[int]) -> tuple[list[float], int | None]:
    """DeepSpeed's scales and the 1-based step at which it raised at its floor (None: never)."""
    out = []
    for i, f in enumerate(flags):
        try:
            ref.update_scale(bool(f))
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises a bare Exception
            assert "already at minimum" in str(e)
            return out, i + 1
        out.append(ref.cur_scale)
    return out, None


def test_verl_is_gradscaler_with_growth_interval_400() -> None:
    flags = bursts(1, 1400, 480)
    assert run(preset("verl"), flags) == (updates(Torch(growth_interval=400), flags), None)


def test_init_2p32_is_gradscaler_from_2_to_the_32() -> None:
    flags = [1] * 3 + [0] * 2100 + bursts(2, 2400, 2300)
    want = updates(Torch(init_scale=2.0**32), flags)
    assert run(preset("init_2p32"), flags) == (want, None)
    assert want[2002] == 2 * want[2] == 2.0**30  # three backoffs, then the 2000-step growth


def test_hysteresis2_is_megatrons_rule_at_torchs_numbers() -> None:
    flags = bursts(3, 4500, 2300)
    assert run(preset("hysteresis2"), flags) == (updates(Megatron(2.0**16, 0.0, 2.0, 0.5, 2000, 2), flags), None)


def test_areal_is_megatron_with_areals_optimizer_defaults() -> None:
    flags = [1] * 40 + bursts(4, 400, 40)  # 2^32 backs off to the floor region, then grows every 5 clean steps
    want = updates(Megatron(2.0**32, 1.0, 2.0, 0.5, 5, 2), flags)
    assert run(preset("areal"), flags) == (want, None)
    assert min(want) == 1.0


@pytest.mark.parametrize("floor_hit", [False, True])
def test_oat_is_deepspeeds_defaults(floor_hit: bool) -> None:
    flags = bursts(5, 2600, 1100) + ([1] * 40 if floor_hit else [])
    want, raised = deepspeed_run(DeepSpeed(2.0**16, 2.0, 1000, 1.0, 2, False, True), flags)
    assert (raised is not None) == floor_hit
    scales, error = run(preset("oat"), flags + [0])
    if raised is None:
        assert error is None and scales[:len(flags)] == want
    else:  # the floor's fault is read at the next step()
        assert scales == want + [want[-1]] and f"step {raised}:" in error


def test_min_scale_1e_10_goes_on_below_1_where_oat_stops() -> None:
    flags = bursts(6, 300, 100) + [1] * 40 + [0] * 20
    want, raised = deepspeed_run(DeepSpeed(2.0**16, 2.0, 1000, 1e-10, 2, False, True), flags)
    assert raised is None and min(want) < 1.0
    assert run(preset("min_scale_1e-10"), flags) == (want, None)
    assert run(preset("oat"), flags)[1] is not None


def test_fairseq_tolerance_is_fairseq_with_tolerance_a_quarter() -> None:
    flags = bursts(7, 600, 12)
    want, stopped = fairseq_trajectory(Fairseq(128.0, 2.0, 2**14, 0.25, None, 1e-4), flags)
    assert len(set(want)) > 2  # backed off, and kept the scale through overflows below a quarter
    scales, error = run(preset("fairseq_tolerance"), flags + [0])
    if stopped is None:
        assert error is None and scales[:len(flags)] == want
    else:  # fairseq's "Minimum loss scale reached": the fault is read at the next step()
        assert scales == want + [want[-1]] and f"step {stopped}:" in error


def test_metaseq_is_metaseqs_defaults() -> None:
    flags = [0] * 600 + bursts(8, 1000, 600)
    want = metaseq_trajectory(Metaseq(), flags)
    assert run(preset("metaseq"), flags) == (want, None)
    assert want[255] == 8.0 and want[511] == 16.0  # from 4: growths after 256 and 256 more clean steps (w = 512)


def test_static8_keeps_8() -> None:
    flags = bursts(9, 100, 20)
    assert run(preset("static8"), flags) == ([8.0] * 100, None)
