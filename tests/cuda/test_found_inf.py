"""One meaning of ``found_inf`` for every rule: nonzero (NaN, negative, infinite included) is an
overflow, as torch's amp_update_scale_ (`if (*found_inf)`) and GradScaler.step (skip when
`sum(found_inf) != 0`); -0.0 is a clean step. Each update op equals its Python twin bit for bit
for such flags, and a flag of NaN / -1 / 0.5 / inf does exactly what 1.0 does."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.samples import SAMPLES, TWINS
from tests.cuda.trajectories import assert_states_equal

FLAGS = [float("nan"), -1.0, 0.5, float("inf"), float("-inf"), -0.0, 2.0**-149]
CASES = [(op, k, f) for op in TWINS for k in range(len(SAMPLES[op])) for f in FLAGS]


def with_flag(op: str, args: tuple, value: float) -> tuple:
    """The sample's arguments (fresh tensors) with found_inf filled with `value`."""
    i = flag_index(op)
    return (*args[:i], torch.full_like(args[i], value), *args[i + 1:])


def flag_index(op: str) -> int:
    return [a.name for a in getattr(torch.ops.scalelab, op).default._schema.arguments].index("found_inf")


def run(fn, args: tuple) -> dict[int, torch.Tensor]:
    fn(*args)
    return {j: a for j, a in enumerate(args) if isinstance(a, torch.Tensor)}


@pytest.mark.parametrize("op,k,flag", CASES, ids=[f"{o}-{k}-{f}" for o, k, f in CASES])
def test_found_inf_flag_means_overflow_iff_nonzero(ops, op, k, flag):
    sample = SAMPLES[op][k]
    got = run(getattr(ops, op), with_flag(op, sample(), flag))
    want = run(TWINS[op], with_flag(op, sample(), flag))
    assert_states_equal(0, tuple(got.values()), tuple(want.values()))
    same_as = 0.0 if flag == 0 else 1.0
    ref = run(TWINS[op], with_flag(op, sample(), same_as))
    for j, r in ref.items():
        if j != flag_index(op):
            assert torch.equal(got[j].nan_to_num(), r.nan_to_num()) and torch.equal(got[j].isnan(), r.isnan()), \
                f"argument {j}: found_inf={flag} does not act as {same_as}"
