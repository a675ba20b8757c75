"""torch.library.opcheck for every op of the extension on the CPU: schema (declared mutations
are the real ones), fake (meta) implementation, autograd registration and AOT dispatch."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from strategies import kernels
from tests.cuda.samples import SAMPLES, TWINS

CASES = [(op, k) for op, makers in SAMPLES.items() for k in range(len(makers))]


def test_samples_cover_every_op(ops):
    """Every op the library defines has opcheck cases, and every update op a Python twin (a new
    op without them fails here)."""
    assert set(kernels.op_names()) == set(SAMPLES) == {"unscale_and_stats", "count_fraction", "boundary_rescale", "grad_extremes",
                                                                  "exponent_histogram", *TWINS}


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


def _fake(mode, args):
    return [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("index,bad,message", [
    (1, torch.zeros(4, dtype=torch.float64), "ema must be Float, got Double"),
    (2, torch.zeros(3, dtype=torch.int32), "ema_steps must have 4 elements, got 3"),
    (5, torch.zeros(2), "found_inf must have 4 or 1 elements, got 2"),
    (6, torch.zeros(4, 2)[:, 0], "grad_absmax must be contiguous"),
])
def test_fake_checks_shapes_and_dtypes_as_the_op_does(ops, index, bad, message):
    """Traced (FakeTensorMode, meta tensors) the update ops refuse what the real op refuses, with
    its message: state tensors [G] of their dtype, found_inf / grad_absmax [G] or [1]."""
    args = list(SAMPLES["max_ema_update_"][2]())  # G = 4, found_inf broadcast
    args[index] = bad
    with pytest.raises(RuntimeError, match=message):
        ops.max_ema_update_(*args)  # the real op: the reference message
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=message):
        ops.max_ema_update_(*_fake(mode, args))
    meta = [a.to("meta") if isinstance(a, torch.Tensor) and a.is_contiguous() else a for a in args]
    if meta[index].device.type == "meta":
        with pytest.raises(RuntimeError, match=message):
            ops.max_ema_update_(*meta)


@pytest.mark.parametrize("op", sorted(TWINS))
def test_fake_accepts_every_sample_and_leaves_the_real_values_alone(ops, op):
    """Every sample argument list passes the fake's checks on meta tensors, and checking a real
    argument list writes nothing into it (the op runs on scratch copies)."""
    args = SAMPLES[op][0]()
    getattr(ops, op)(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kernels.check_update_args(getattr(ops, op).default, args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
