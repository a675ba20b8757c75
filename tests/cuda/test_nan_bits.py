"""The NaN a rule stores is the one its Python twin stores on the CPU, bit for bit: the first NaN
operand quietened (payload and sign kept), or the host's default NaN for an invalid operation
(0/0: 0xffc00000 on x86-64). The CUDA kernels rewrite their canonical 0x7fffffff into these bits
(``host_nan`` in cuda/include/scalelab_common.h); a host program checks that rule against the
CPU's own arithmetic, and the ops against the twins (test_gpu_trajectories.py runs the kernels)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from strategies import kernel_build
from strategies.rules.hybrid import hybrid_update_
from strategies.rules.max_ema import max_ema_update_
from strategies.rules.norm_ratio import norm_ratio_update_
from tests.cuda.trajectories import assert_states_equal

I32, I64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFD00001, 0x7F800001]  # the last: signalling


def f32(bits: int) -> torch.Tensor:
    return torch.tensor(bits if bits < 2**31 else bits - 2**32, dtype=torch.int32).view(torch.float32)


def bits(t: torch.Tensor) -> int:
    return int(t.reshape(()).view(torch.int32)) & 0xFFFFFFFF


def quiet(b: int) -> int:
    return b | 0x00400000


@pytest.mark.parametrize("nan", NAN_BITS, ids=hex)
def test_max_ema_candidate_of_a_nan_absmax_is_that_nan_quietened(ops, nan):
    state = (torch.tensor(2.0**15), torch.zeros(()), torch.zeros((), **I32), torch.zeros((), **I32), torch.zeros(()))
    twin = tuple(t.clone() for t in state)
    args = (torch.tensor(0.0), f32(nan), 32768.0, 0.9, 2.0, 0.5, 2, False, True)
    ops.max_ema_update_(*state, *args)
    max_ema_update_(*twin, *args)
    assert_states_equal(0, state, twin)
    assert bits(twin[4]) == quiet(nan), hex(bits(twin[4]))


@pytest.mark.parametrize("nan", NAN_BITS, ids=hex)
def test_hybrid_candidate_of_a_nan_absmax_is_torchs_nan(ops, nan):
    """The GPU run's failing case (test_gpu_trajectories.py, hybrid, state 4): G = amax over the groups is
    NaN (torch.amax writes 0x7fc00000 whatever the payload), found_inf 0."""
    state = (torch.tensor(2.0**15), torch.zeros(()), torch.zeros((), **I32), torch.zeros((), **I32),
             torch.zeros(()), torch.zeros(()), torch.zeros((), **I32), torch.zeros(()), torch.zeros((), **I64),
             torch.ones(()), torch.zeros(()))
    twin = tuple(t.clone() for t in state)
    args = (torch.tensor(0.0), torch.stack([torch.tensor(3.0), f32(nan)]), torch.tensor(0.5), torch.tensor(4.0),
            torch.tensor(1.0), True, True, 32768.0, 0.9, 2.0, 0.5, 2, False, True, False, 0.1, 8.0, 0.125, 0.5)
    ops.hybrid_update_(*state, *args)
    hybrid_update_(*twin, *args)
    assert_states_equal(0, state, twin)
    assert bits(twin[4]) == 0x7FC00000, hex(bits(twin[4]))


@pytest.mark.parametrize("ref,mp", [(0.0, 0.0), (float("inf"), float("inf")), (0x7FC12345, 4.0), (-1.0, 4.0)],
                         ids=["0/0", "inf/inf", "nan/x", "sqrt(-1)/x"])
def test_norm_ratio_last_ratio_nan_bits_equal_the_twin(ops, ref, mp):
    """last_ratio = sqrt(ref) / sqrt(mp) is stored even when NaN: created (0/0, inf/inf,
    sqrt(-1)) or propagated, the op writes the twin's bits."""
    r = f32(ref) if isinstance(ref, int) else torch.tensor(ref)
    state = (torch.tensor(2.0**15), torch.zeros((), **I32), torch.zeros(()), torch.zeros((), **I32), torch.zeros(()))
    twin = tuple(t.clone() for t in state)
    args = (torch.tensor(0.0), r, torch.tensor(mp), True, 2.0, 0.5, 2, 8.0, 0.125, 0.5)
    ops.norm_ratio_update_(*state, *args)
    norm_ratio_update_(*twin, *args)
    assert_states_equal(0, state, twin)
    assert torch.isnan(twin[4])


HOST_PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include "scalelab_common.h"
using namespace scalelab;
static uint32_t u(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
static float f(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
int main() {
  const uint32_t in[] = {0x7fc00000u, 0xffc00000u, 0x7fc12345u, 0xffd00001u, 0x7f800001u, 0x00000000u,
                         0x80000000u, 0x7f800000u, 0xff800000u, 0x3f800000u, 0xbf800000u};
  int bad = 0, nans = 0;
  for (uint32_t a : in) for (uint32_t b : in) {
    const float x = f(a), y = f(b);
    const float r[] = {x * y, x + y, x - y, x / y};
    for (float v : r) {
      if (!is_nan(v)) continue;
      ++nans;
      if (is_nan(x) && is_nan(y)) continue;  // two NaN operands: order-dependent, never stored
      if (u(v) != u(host_nan(x, y))) { std::printf("%08x %08x -> %08x, host_nan %08x\n", a, b, u(v), u(host_nan(x, y))); ++bad; }
    }
    const float s = __builtin_sqrtf(x);
    if (is_nan(x) && u(s) != u(host_nan(x, x))) { std::printf("sqrt %08x -> %08x\n", a, u(s)); ++bad; }
  }
  std::printf("nans %d bad %d\n", nans, bad);
  return bad != 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_host_nan_is_the_host_cpus_own_nan(tmp_path: Path):
    """host_nan(a, b), which the CUDA rules write for a NaN result, equals the NaN this CPU's
    float32 *, +, -, / produce (propagated payloads, signalling quietened, created NaN) and sqrt
    of a NaN (rn_sqrt creates torch's NaN for a negative argument, as the twins' torch.sqrt)."""
    src, exe = tmp_path / "nan.cpp", tmp_path / "nan"
    src.write_text(HOST_PROGRAM)
    res = subprocess.run(["g++", "-std=c++17", "-O0", "-ffp-contract=off", "-I", str(kernel_build.source_dir() / "include"),
                          str(src), "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout
    assert int(run.stdout.split()[-3]) > 50, run.stdout  # the grid really made NaNs
