"""PyTorch's own FSDP grad-scaler tests, re-written over every rule and preset (issue 29), with
torch's ``ShardedGradScaler`` (FSDP1) and ``GradScaler`` (FSDP2) run through the same code as the
reference that must pass them too. Runs: :mod:`tests.strategies.torch_fsdp_cases`.

* ``TestShardGradScaler`` (one process): scaling nested outputs, unscaling sparse gradients (an
  fp16 one whose duplicate indices sum to an overflow), skipping an Inf step — every strategy
  with ``distributed="sharded"``, which also keeps the loss's dtype (ShardedGradScaler's
  ``scale`` returns an fp16 loss for an fp16 one) and accepts fp16 gradients.
* ``TestShardedGradScalerParityWithDDP`` (2 gloo ranks): FSDP1 (``SHARD_GRAD_OP``/``FULL_SHARD``
  x fp16 mixed precision or not x ``use_orig_params``) trains 2 steps to the DDP reference's
  loss (and parameters, without mixed precision), with the same scaler kind on both sides. A
  probing rule (``norm_ratio``, ``hybrid``) gets its fp32 reference closure on both sides (on
  main the probe's backward went through FSDP1's hooks and corrupted the gradients). Per-layer
  rules refuse ``use_orig_params=False`` in one line, and the probe refuses FSDP's fp16
  parameters (its reference cannot be fp32 there), in one line.
* ``TestFullyShardGradientScaler`` (2 gloo ranks, FSDP2): ``unscale_`` on the local shard, the
  Inf on rank 1 found on both ranks, ``step`` skipped or taken, ``update`` backing off or not;
  a 2-D mesh (HSDP) is refused in one line.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.amp.grad_scaler import OptState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

import strategies
from tests.helpers import fp16_safe, strategy_cases
from tests.strategies.gloo import run_ranks
from tests.strategies.gradscaler_cases import torch_rule
from tests.strategies.torch_fsdp_cases import CONFIGS, fsdp_ddp_parity, gradient_scaler_fsdp2

CASES = strategy_cases()
TORCH = "torch"
IDS = [TORCH] + [c.id for c in CASES]
KW = {c.id: c.values for c in CASES}
PER_LAYER = {"layerwise", "underflow_target"}
PROBES = {"norm_ratio", "hybrid"}


def sharded(name: str, kw: dict, **more: Any) -> strategies.Strategy:
    return strategies.create(name, "cpu", **{**kw, "distributed": "sharded", **more})


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name,kw", CASES)
def test_grad_scaling(name: str, kw: dict) -> None:
    s = sharded(name, kw, init_scale=2.0)
    if not s.is_enabled():
        pytest.skip("disabled preset")
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0)
    out = s.scale([t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]])
    assert out[0] == 16.0 and out[1][0] == 8.0 and out[1][1] == 16.0
    assert out[2][0] == 8.0 and out[2][1] == 16.0
    assert s._scale.device == t1.device
    half = s.scale(torch.full((), 3.0, dtype=torch.float16))  # ShardedGradScaler keeps the loss's dtype
    assert half.dtype == torch.float16 and half.item() == 6.0
    assert strategies.create(name, "cpu", **{**kw, "init_scale": 2.0}).scale(half).dtype == torch.float32  # GradScaler


@pytest.mark.parametrize("name,kw", CASES)
def test_scaling_unscaling_sparse(name: str, kw: dict) -> None:
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    for values, dtype, found in (([16.0, 32.0, 64.0], torch.float32, 0.0), ([16.0, 32.0, math.inf], torch.float32, 1.0),
                                 ([2.0**15, 2.0**15, 1.0], torch.float16, 1.0)):
        s = sharded(name, kw, init_scale=2.0)
        if not s.is_enabled():
            pytest.skip("disabled preset")
        s.scale(torch.ones(()))
        index = torch.tensor([[1, 1, 1], [0, 0, 2]]) if dtype == torch.float16 else i  # fp16: a duplicate index
        p = torch.sparse_coo_tensor(index, torch.tensor(values), (2, 3)).to(dtype)
        p.grad = p.clone()
        opt = torch.optim.SGD([p], lr=1.0)
        s.unscale_(opt)
        assert sum(v.item() for v in s._per_optimizer_states[id(opt)]["found_inf_per_device"].values()) == found
        if not found:
            assert torch.equal(p.grad.to_dense(), (p / 2).to_dense())


@pytest.mark.parametrize("name,kw", CASES)
def test_inf_gradients_skip_optim_step(name: str, kw: dict) -> None:
    s = sharded(name, kw, init_scale=2.0)
    t0 = torch.tensor([float("inf")])
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    s.scale(torch.full((1,), 4.0))
    assert s.step(opt) is None
    s.update()
    if s.is_enabled():
        assert s.telemetry()["skipped_steps"].item() == 1


# ----------------------------------------------------------------------------- two ranks
def _make(cid: str, kind: str, orig: bool = False):
    """The scaler factory of case ``cid`` (``torch``: ShardedGradScaler / GradScaler), with torch's
    ``init_scale``: 2 for FSDP2, 2^11 for ``NonUniformReqGradNWM`` (``use_orig_params``), else the default."""
    more = {"init_scale": 2.0} if kind == "fsdp2" else {"init_scale": 2.0**11} if orig else {}

    def make(model: torch.nn.Module, current: dict) -> Any:
        if cid == TORCH:
            return ShardedGradScaler("cpu", **more) if kind == "fsdp1" else torch.amp.GradScaler("cpu", **more)
        name, kw = KW[cid][0], fp16_safe(KW[cid][1])  # an fp16 loss x Megatron's 2^32 is Inf
        s = sharded(name, kw, **more) if kind == "fsdp1" else strategies.create(name, "cpu", **{**kw, **more})
        plain = model.module if isinstance(model, DDP) else model  # the probe runs the plain DDP module
        s.attach(plain)
        s.set_reference(lambda: plain(current["x"].float()).sum())
        return s

    return make


def _outcome(run: Any, *args: Any) -> Any:
    try:
        return run(*args)
    except Exception as exc:  # one line, recorded: the test checks which refusals are expected
        return f"{type(exc).__name__}: {exc}"


def _hsdp(rank: int) -> str:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(model, mesh=mesh)
    s = strategies.create("native", "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.scale(model(torch.randn(2, 4)).sum()).backward()
    return _outcome(s.step, opt)


def _all(rank: int) -> dict:
    out: dict[Any, Any] = {}
    for cid in IDS:
        for config in CONFIGS:
            out[("fsdp1", cid, config)] = _outcome(fsdp_ddp_parity, _make(cid, "fsdp1", config[2]), *config)
        for has_inf in (True, False):
            out[("fsdp2", cid, has_inf)] = _outcome(gradient_scaler_fsdp2, _make(cid, "fsdp2"), has_inf)
    out["hsdp"] = _hsdp(rank)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_all, tmp_path_factory.mktemp("torch_fsdp"))


def _expected_refusal(cid: str, mixed: bool, orig: bool) -> str | None:
    if cid == TORCH:
        return None
    name = KW[cid][0]
    if name in PER_LAYER and not orig:
        return f"ShardingError: {name}: FSDP1 with use_orig_params=False trains flat parameters"
    if name in PROBES and mixed:
        return f"LowPrecisionReference: {name}: the fp32 reference forward computed"
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{s}-{'mp' if m else 'fp32'}-{'orig' if o else 'flat'}"
                                                 for s, m, o in CONFIGS])
@pytest.mark.parametrize("cid", IDS)
def test_fsdp_ddp_parity_with_grad_scaler(ranks: list[dict], cid: str, config: tuple) -> None:
    for rank, out in enumerate(ranks):
        got = out[("fsdp1", cid, config)]
        refusal = _expected_refusal(cid, config[1], config[2])
        if refusal is not None:
            assert isinstance(got, str) and got.startswith(refusal) and "\n" not in got, got
            continue
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["ref_loss"], got["loss"], check_dtype=False)
        if not config[1]:  # parameters, without mixed precision
            for a, b in zip(got["ref_params"], got["params"]):
                torch.testing.assert_close(a, b)


@pytest.mark.distributed
@pytest.mark.parametrize("has_inf", [True, False])
@pytest.mark.parametrize("cid", IDS)
def test_gradient_scaler_fsdp2(ranks: list[dict], cid: str, has_inf: bool) -> None:
    for out in ranks:
        got = out[("fsdp2", cid, has_inf)]
        assert not isinstance(got, str), got
        if "disabled" in got:
            continue
        assert got["found"] == [float(has_inf)] and got["stage"] == OptState.UNSCALED.value and got["unscaled_ok"]
        assert got["stepped"] is not has_inf
        # a per-group rule backs off the group where the overflow arose (the first layer's), not the loss side's
        before, after = got["first"] if cid != TORCH and strategies.get(KW[cid][0]).per_group else got["scales"]
        if has_inf and (cid == TORCH or torch_rule(sharded(*KW[cid]))):
            assert after == before * got["backoff"]
        elif has_inf and KW[cid][0] != "static" and KW[cid][1].get("hysteresis", 1) == 1:
            assert after < before
        elif not has_inf and (cid == TORCH or torch_rule(sharded(*KW[cid]))):
            assert after == before


@pytest.mark.distributed
def test_a_2d_mesh_is_refused_naming_hsdp(ranks: list[dict]) -> None:
    for out in ranks:
        assert out["hsdp"].startswith("ShardingError: native: a DTensor gradient on a 2-D device mesh (HSDP"), out["hsdp"]
