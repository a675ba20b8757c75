"""`native`'s industry variants against plain-Python re-statements of their sources.

Each reference class (``tests/strategies/restated.py``) re-states, line for line, the source's own
update function:

* Megatron-LM ``megatron/core/optimizer/grad_scaler.py`` ``DynamicGradScaler.update``;
* DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``
  (``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``, ``raise_error_at_min_scale``);
* Apex ``csrc/update_scale_hysteresis.cu`` ``update_scale_hysteresis_cuda_kernel``.

Random overflow sequences drive the strategy through real scale/unscale_/step/update calls; its
scale after every update must equal the reference's exactly (factors 2 and 1/2, power-of-two
scales: float32 and Python floats agree bit for bit).
"""

from __future__ import annotations

import random

import pytest
import torch

import strategies
from strategies.base import ScaleFloorError
from tests.strategies.drivers import drive, run
from tests.strategies.restated import Apex, DeepSpeed, Megatron


def random_case(seed: int) -> tuple[list[int], dict]:
    rng = random.Random(seed)
    p = rng.choice([0.1, 0.3, 0.6, 0.85])
    flags = [int(rng.random() < p) for _ in range(rng.randint(20, 70))]
    knobs = dict(init_scale=2.0 ** rng.randint(0, 10), growth_interval=rng.choice([1, 2, 3, 5]),
                 hysteresis=rng.choice([1, 2, 3]))
    return flags, knobs


SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_growth_refill_equals_megatron(seed: int) -> None:
    flags, k = random_case(seed)
    ref = Megatron(k["init_scale"], 1.0, 2.0, 0.5, k["growth_interval"], k["hysteresis"])
    expected = []
    for f in flags:
        ref.update(bool(f))
        expected.append(ref._scale)
    s = strategies.create("native", min_scale=1.0, hysteresis_refill="growth", **k)
    assert run(s, flags) == (expected, None)


def deepspeed_expected(flags: list[int], ref: DeepSpeed) -> tuple[list[float], int | None]:
    """The reference's scales, and the 1-based step at which it raised (None: never)."""
    out = []
    for i, f in enumerate(flags):
        try:
            ref.update_scale(bool(f))
        except Exception as e:
            assert "already at minimum" in str(e)
            return out, i + 1
        out.append(ref.cur_scale)
    return out, None


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("raise_at_min", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_equals_deepspeed(seed: int, consecutive: bool, raise_at_min: bool) -> None:
    flags, k = random_case(seed)
    ref = DeepSpeed(k["init_scale"], 2.0, k["growth_interval"], 1.0, k["hysteresis"], consecutive, raise_at_min)
    expected, raised_at = deepspeed_expected(flags, ref)
    s = strategies.create("native", min_scale=1.0, hysteresis_refill="clean_step" if consecutive else "growth",
                          on_min_scale="raise" if raise_at_min else "clamp", **k)
    # The fault is read at the next step(): run one more (clean) step after the sequence.
    scales, error = run(s, flags + [0])
    if raised_at is None:
        assert error is None and scales[: len(flags)] == expected
    else:
        assert scales == expected + [expected[-1] if expected else k["init_scale"]]
        assert error is not None and f"step {raised_at}:" in error and "\n" not in error


def test_the_random_cases_reach_every_branch() -> None:
    """The sequences above do exercise what they test: DeepSpeed raises in some, not all."""
    outcomes = set()
    for seed in SEEDS:
        flags, k = random_case(seed)
        ref = DeepSpeed(k["init_scale"], 2.0, k["growth_interval"], 1.0, k["hysteresis"], True, True)
        outcomes.add(deepspeed_expected(flags, ref)[1] is None)
    assert outcomes == {True, False}


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_step_refill_equals_apex(seed: int) -> None:
    flags, k = random_case(seed)
    ref = Apex(k["init_scale"], 2.0, 0.5, k["growth_interval"], k["hysteresis"])
    expected = []
    for f in flags:
        ref.update(float(f))
        expected.append(ref.scale)
    s = strategies.create("native", hysteresis_refill="clean_step", **k)
    assert run(s, flags) == (expected, None)


def test_refill_modes_hand_computed() -> None:
    """H=2, interval 4: overflow, clean, overflow. growth: the budget (spent to 1) is not back
    until a growth, so the second overflow backs off; clean_step: refilled, it does not."""
    flags = [1, 0, 1, 0, 1, 1]
    growth = strategies.create("native", init_scale=64.0, growth_interval=4, hysteresis=2)
    clean = strategies.create("native", init_scale=64.0, growth_interval=4, hysteresis=2,
                              hysteresis_refill="clean_step")
    assert run(growth, flags)[0] == [64.0, 64.0, 32.0, 32.0, 16.0, 8.0]
    assert run(clean, flags)[0] == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]


def count_host_reads():
    calls = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}

    def wrap(fn):
        def counted(self, *a, **kw):
            calls["n"] += 1
            return fn(self, *a, **kw)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(fn))
    return calls, lambda: [setattr(torch.Tensor, n, f) for n, f in saved.items()]


@pytest.mark.parametrize("on_min_scale", ["clamp", "raise"])
def test_raise_adds_no_host_read_to_step(on_min_scale: str) -> None:
    s = strategies.create("native", init_scale=4.0, min_scale=1.0, on_min_scale=on_min_scale)
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.0)
    s.scale(p * 0 + 1.0).backward()
    s.unscale_(opt)
    calls, restore = count_host_reads()
    try:
        s.step(opt)
    finally:
        restore()
    assert calls["n"] == 1  # GradScaler's one skip-decision read, the fault flag inside it


def test_raise_is_not_armed_by_an_overflow_above_the_floor_or_by_clamp() -> None:
    # 4 -> 2 -> 1 (the floor) -> overflow at the floor: the raise names step 3.
    s = strategies.create("native", init_scale=4.0, min_scale=1.0, on_min_scale="raise")
    scales, error = run(s, [1, 1, 0, 1, 0])
    assert scales == [2.0, 1.0, 1.0, 1.0] and error is not None and "step 4:" in error
    assert isinstance(ScaleFloorError("x"), ValueError)
    clamp = strategies.create("native", init_scale=4.0, min_scale=1.0)
    assert run(clamp, [1, 1, 0, 1, 0]) == ([2.0, 1.0, 1.0, 1.0, 1.0], None)


def test_with_a_fused_optimizer_the_fault_is_caught_at_the_logging_read() -> None:
    s = strategies.create("native", init_scale=1.0, min_scale=1.0, on_min_scale="raise")
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    for f in (1, 0):
        opt.zero_grad()
        s.scale((p * 0 + 1.0).sum()).backward()
        if f:
            p.grad.fill_(float("inf"))
        s.step(opt)  # fused: no host read, nothing raised here
        s.update()
    assert s.telemetry()["fault"].item() == 1
    with pytest.raises(ScaleFloorError, match=r"^native: step 1: "):
        s.get_scale()


@pytest.mark.parametrize("field,value,message", [
    ("hysteresis_refill", "sometimes", "hysteresis_refill must be one of 'growth', 'clean_step', got 'sometimes'"),
    ("on_min_scale", "explode", "on_min_scale must be one of 'clamp', 'raise', got 'explode'"),
])
def test_new_fields_validated(field: str, value, message: str) -> None:
    with pytest.raises(ValueError) as e:
        strategies.create("native", **{field: value})
    assert str(e.value) == message


def test_raise_needs_a_min_scale() -> None:
    with pytest.raises(ValueError, match=r"^min_scale must be a number when on_min_scale='raise', got None$"):
        strategies.create("native", on_min_scale="raise")


def test_fault_is_saved_and_validated() -> None:
    s = strategies.create("native", init_scale=1.0, min_scale=1.0, on_min_scale="raise")
    run(s, [1])
    sd = s.state_dict()
    assert sd["extra"]["fault"] == 1
    assert "fault" not in strategies.create("native").state_dict().get("extra", {})
    bad = dict(sd, extra=dict(sd["extra"], fault=-1))
    with pytest.raises(ValueError, match="'fault' must be >= 0"):
        strategies.create("native", min_scale=1.0, on_min_scale="raise").load_state_dict(bad)
