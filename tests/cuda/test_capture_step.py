"""Issue 33, item 4 on a GPU: a strategy's whole step — scaled backward, ``step`` with a fused,
capturable Adam (the skip decision stays on the device: the optimizer reads ``found_inf``) and
``update`` — captured once in a ``torch.cuda.graph`` and replayed, gives bit for bit the
parameters and strategy state of the same steps run eagerly, an overflow step included. Every
capturable strategy of ``tests/capture.py`` (the CPU check of the same conditions:
``tests/strategies/test_capturable.py``). Skipped without CUDA; prepared without one (no GPU was
lent when it was written: run it with ``make gpu-pass``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import strategies
from tests.capture import MULTS, capture_cases
from tests.cuda.gradients import assert_bits_equal
from tests.helpers import batch, fp16_safe, mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WARM = 3  # eager steps on a side stream before the capture (torch.cuda.graphs' recipe)
CAPTURABLE = capture_cases()[0]


def _setup(name: str, kw: dict):
    model = mlp(seed=0).cuda()
    x, y = (t.cuda() for t in batch(0))
    mult = torch.ones((), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = strategies.create(name, "cuda", **fp16_safe(kw))
        s.attach(model)
        s.set_reference(lambda: F.mse_loss(model(x), y))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)

    def step() -> None:
        # no autocast weight cache: its casts would be graph-pool tensors freed at the context's exit
        # (torch.cuda.make_graphed_callables refuses the cache for the same reason); numerics unchanged
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            loss = F.mse_loss(model(x), y) * mult
        s.scale(loss).backward()
        s.step(opt)
        s.update()

    return model, s, opt, mult, step


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, NaN where the eager run has NaN (torch.equal calls NaN unequal to itself: a
    rule's 'no candidate yet' state is NaN, and unscaled training reaches NaN parameters)."""
    try:
        assert_bits_equal(got.detach().cpu().reshape(-1), want.detach().cpu().reshape(-1))
    except AssertionError as exc:
        pytest.fail(f"{what}: {exc}")


def _state(s: strategies.Strategy) -> dict[str, torch.Tensor]:
    return {k: v for k, v in s.telemetry().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name,kw", CAPTURABLE)
def test_captured_step_equals_eager_steps(name: str, kw: dict) -> None:
    eager_model, eager_s, eager_opt, eager_mult, eager_step = _setup(name, kw)
    for m in MULTS:
        eager_mult.fill_(m)
        eager_opt.zero_grad(set_to_none=True)
        eager_step()

    model, s, opt, mult, step = _setup(name, kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for m in MULTS[:WARM]:
            mult.fill_(m)
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    for m in MULTS[WARM:]:
        mult.fill_(m)
        graph.replay()
    torch.cuda.synchronize()

    for k, (p, q) in enumerate(zip(model.parameters(), eager_model.parameters())):
        _same_bits(p, q, f"{name}: parameter {k} after the replayed steps")
    got, want = _state(s), _state(eager_s)
    for key in want.keys() & got.keys() - {"updates"}:
        _same_bits(got[key], want[key], f"{name}: state {key} {got[key]} vs eager {want[key]}")
    if "skipped_steps" in want:
        assert int(want["skipped_steps"]) == MULTS.count(float("inf"))
