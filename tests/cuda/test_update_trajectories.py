"""The update ops of the rules in tests/cuda/trajectories.py (amax_history, hybrid, learned,
underflow_target, tolerance: cuda/include/rules/<rule>.h, and layerwise's AdaLoss:
rules/adaloss.h), the CPU twin of their CUDA kernels, equal their strategies' Python twins,
bit for bit on every state tensor, over long random trajectories.

learned and hybrid's probe evaluate log2 / exp2 / pow in double and round once to float32 on
both sides (the twin through torch on float64 tensors, the op through the C library): two double
results that differ by an ulp round to the same float32 unless they straddle a float32 rounding
boundary (about 2^-29 per evaluation), so bit equality holds on these fixed seeds."""

from __future__ import annotations

import pytest

from tests.cuda.trajectories import CASES, TRAJECTORIES, run_pair, with_loader


@pytest.mark.parametrize("op_name,case", CASES, ids=[f"{o}-{'-'.join(map(str, c))}" for o, c in CASES])
def test_update_op_matches_twin(ops, op_name, case):
    twin, build, _ = TRAJECTORIES[op_name]
    state, steps, hyper, check = build(case)
    run_pair(with_loader(op_name, getattr(ops, op_name)), with_loader(op_name, twin), state, steps, hyper)
    check(state)
