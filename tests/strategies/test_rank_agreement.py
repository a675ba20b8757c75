"""Ranks that hold different scaler states are refused, not left to hang or diverge (issue 29).

One rank resumes from a stale checkpoint (its ``state_dict`` from a step earlier): its update
count differs, so ``norm_ratio`` would run its fp32 probe (a backward and collectives) on one rank
and not on the other and the collectives would pair up wrongly (on main: a hang, or gloo's size
error); the other rules would train on with different scales, as torch's scalers do. Every rule
must instead raise the same one-line :class:`strategies.agreement.StateMismatch` on both ranks at
the next step. The process group's timeout (30 s) turns a hang into a failure.

After the one check, the steps read nothing on the host: ``scale``, ``unscale_`` and ``update``
run under :func:`tests.helpers.forbid_host_sync` on both ranks.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import strategies
from tests.helpers import batch, forbid_host_sync, mlp
from tests.strategies.gloo import run_ranks

pytestmark = pytest.mark.distributed


def _strategy(name: str, model: torch.nn.Module, current: dict) -> strategies.Strategy:
    s = strategies.create(name, "cpu", init_scale=2.0**10, growth_interval=1,
                          **({"probe_interval": 2} if name == "norm_ratio" else {}))
    s.attach(model)
    s.set_reference(lambda: (model(current["x"]) - current["y"]).square().mean(), model.parameters())
    return s


def _step(s: strategies.Strategy, ddp: torch.nn.Module, opt: torch.optim.Optimizer, current: dict, step: int,
          rank: int, quiet: bool = False) -> None:
    x, y = batch(step + 10 * rank)
    current.update(x=x, y=y)
    opt.zero_grad(set_to_none=True)
    with forbid_host_sync() if quiet else nullcontext():
        s.scale((ddp(x) - y).square().mean()).backward()
        s.unscale_(opt)
    s.step(opt)  # GradScaler's one read (found_inf)
    with forbid_host_sync() if quiet else nullcontext():
        s.update()


def _stale(name: str, rank: int) -> str:
    """Three steps, then rank 1 loads the state after step 2 (norm_ratio probes at its next step) and rank 0
    the current one (no probe); the next step."""
    model, current = mlp(seed=0), {}
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = _strategy(name, model, current)
    saved = []
    for step in range(3):
        _step(s, ddp, opt, current, step, rank)
        saved.append(s.state_dict())
    s.load_state_dict(saved[1] if rank == 1 else saved[2])
    try:
        _step(s, ddp, opt, current, 3, rank)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        s.detach()
    return "no error"


def _quiet(name: str, rank: int) -> str:
    """The same state everywhere: the first step checks it, the next ones read nothing on the host."""
    model, current = mlp(seed=0), {}
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = _strategy(name, model, current)
    try:
        _step(s, ddp, opt, current, 0, rank)
        for step in range(1, 3):
            _step(s, ddp, opt, current, step, rank, quiet=True)
        return f"ok {s.get_scale()}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        s.detach()


def _all(rank: int) -> dict:
    return {(name, kind): run(name, rank) for name in strategies.available() for kind, run in
            (("stale", _stale), ("quiet", _quiet))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_all, tmp_path_factory.mktemp("agreement"), timeout_s=30.0)


@pytest.mark.parametrize("name", strategies.available())
def test_a_stale_rank_is_refused_on_every_rank(ranks: list[dict], name: str) -> None:
    a, b = (r[(name, "stale")] for r in ranks)
    assert a == b, f"the ranks ended differently:\n{a}\n{b}"
    assert a.startswith("StateMismatch: "), a
    assert "\n" not in a and f"{name}: the 2 ranks hold different scaler states (update counts 2..3" in a


@pytest.mark.parametrize("name", strategies.available())
def test_after_the_check_no_step_reads_the_host(ranks: list[dict], name: str) -> None:
    a, b = (r[(name, "quiet")] for r in ranks)
    assert a == b and a.startswith("ok "), f"{a}\n{b}"
