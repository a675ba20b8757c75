"""torch.library.opcheck for every op of the extension on the CPU: schema (declared mutations
are the real ones), fake (meta) implementation, autograd registration and AOT dispatch."""

from __future__ import annotations

import pytest
import torch

from strategies import kernels
from tests.cuda.samples import SAMPLES, TWINS

CASES = [(op, k) for op, makers in SAMPLES.items() for k in range(len(makers))]


def test_samples_cover_every_op(ops):
    """Every op the library defines has opcheck cases, and every update op a Python twin (a new
    op without them fails here)."""
    assert set(kernels.op_names()) == set(SAMPLES) == {"unscale_and_stats", "count_fraction", *TWINS}


@pytest.mark.parametrize("op,case", CASES, ids=[f"{op}-{k}" for op, k in CASES])
def test_opcheck(ops, op, case):
    torch.library.opcheck(getattr(ops, op).default, SAMPLES[op][case]())


@pytest.mark.parametrize("op", list(SAMPLES))
def test_fake_is_registered(ops, op):
    """The fake implementation runs under FakeTensorMode and gives the real op's output metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = getattr(ops, op)(*SAMPLES[op][-1]())
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor)
                else [mode.from_tensor(x) for x in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                else a for a in SAMPLES[op][-1]()]
        fake = getattr(ops, op)(*args)
    if real is None:
        assert fake is None
    elif isinstance(real, torch.Tensor):
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    else:
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
