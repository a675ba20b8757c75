"""PyTorch's FSDP grad-scaler tests, re-stated for the CPU and gloo, with any scaler.

Sources (torch 2.13): ``test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py``
(``TestShardedGradScalerParityWithDDP.test_fsdp_ddp_parity_with_grad_scaler``, which runs
``FSDPTest._test_fsdp_parity`` and ``_train_for_several_steps`` of
``torch/testing/_internal/common_fsdp.py`` with the models ``NestedWrappedModule`` and, for
``use_orig_params=True``, ``NonUniformReqGradNWM``) and
``test/distributed/_composable/fsdp/test_fully_shard_grad_scaler.py`` (``_test_gradient_scaler``).
Differences, all forced by the CPU: the DDP reference's autocast is fp16 (CPU autocast defaults
to bf16; torch's GPU runs are fp16 on both sides) and its loss is summed in fp32, as CUDA's
autocast sums (the CPU's sums an fp16 output in fp16); ``CPUOffload(offload_params=True)`` and the
``CUDA_BEFORE``/``CUDA_AFTER`` init modes are not run (the parameters are on the CPU already);
the FSDP2 test's 2-D (tensor-parallel) half needs 4 GPUs and is replaced by the refusal of a 2-D
mesh. A scaler is made by ``make(model)`` (the model it will scale, for ``attach`` and the probe's
reference), so the same runs take torch's ``ShardedGradScaler``/``GradScaler`` and every strategy.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["CONFIGS", "Nested", "fsdp_ddp_parity", "gradient_scaler_fsdp2", "nested_model"]

CONFIGS = [(s, mp, orig) for s in ("SHARD_GRAD_OP", "FULL_SHARD") for mp in (False, True) for orig in (False, True)]
"""(sharding strategy, mixed precision, use_orig_params): torch's matrix without CPU offload."""


class Nested(nn.Module):
    """``NestedWrappedModule``'s shape: its layers under ``self.module``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.module = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def nested_model(wrap: Callable[[nn.Module], nn.Module] | None, non_uniform: bool) -> nn.Module:
    """``NestedWrappedModule`` (``non_uniform=False``) or ``NonUniformReqGradNWM``: Linear layers,
    some FSDP-wrapped (``wrap``; None: the plain model of the DDP reference), seeded alike."""
    w = wrap or (lambda m: m)
    torch.manual_seed(0)
    first, middle = nn.Linear(8, 4), w(nn.Sequential(w(nn.Linear(4, 16)), nn.Linear(16, 16)))
    if non_uniform:
        model = Nested([first, middle, w(nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 8)))])
        pattern = re.compile(r"module\.2.*\.1.*")  # only module.2.1 trains: some ranks hold no shard of it
        for n, p in model.named_parameters():
            if not pattern.match(n):
                p.requires_grad_(False)
        return model
    return Nested([first, middle, w(nn.Linear(16, 4)), nn.Linear(4, 8)])


def _train(model: nn.Module, make: Callable[[nn.Module, dict], Any], mixed: bool, fsdp: bool, steps: int = 2) -> Any:
    """``_train_for_several_steps``: SGD with momentum, ``output.sum()`` losses, the scaler's
    step and update, and a save + zero + load of the model's state dict after each step."""
    rank = dist.get_rank()
    current: dict[str, torch.Tensor] = {}
    scaler = make(model, current)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(steps):
        optim.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=mixed and not fsdp):
            torch.manual_seed(1 + rank)
            x = torch.rand(4, 8)
            if mixed and not fsdp:
                x = x.half()
            current["x"] = x
            out = model(x)
            loss = (out.float() if mixed and not fsdp else out).sum()  # CUDA's autocast sums in fp32; the CPU's does not
        loss = scaler.scale(loss)
        expected = torch.float16 if mixed and fsdp else torch.float32
        if loss.dtype != expected:
            raise AssertionError(f"scaled loss is {loss.dtype}, expected {expected}")
        loss.backward()
        scaler.step(optim)
        scaler.update()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with FSDP.summon_full_params(model) if fsdp else torch.no_grad():
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        model.load_state_dict(state)
    return loss.detach(), scaler


def fsdp_ddp_parity(make: Callable[[nn.Module, dict], Any], sharding: str, mixed: bool, orig: bool) -> dict:
    """``_test_fsdp_parity``: DDP reference, then the FSDP1 model; the losses after 2 steps and,
    without mixed precision, the full parameters. Returns what the test compares."""
    ddp = DDP(nested_model(None, orig))
    ref_loss, ref_scaler = _train(ddp, make, mixed, fsdp=False)
    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16) \
        if mixed else None
    kw = dict(sharding_strategy=getattr(ShardingStrategy, sharding), mixed_precision=mp, use_orig_params=orig,
              device_id=torch.device("cpu"))
    fsdp = FSDP(nested_model(lambda m: FSDP(m, **kw), orig), **kw)
    loss, scaler = _train(fsdp, make, mixed, fsdp=True)
    with FSDP.summon_full_params(fsdp):
        params = [p.detach().clone() for p in fsdp.parameters()]
    return {"ref_loss": ref_loss, "loss": loss, "ref_params": [p.detach().clone() for p in ddp.parameters()],
            "params": params, "scales": (ref_scaler.get_scale(), scaler.get_scale())}


def gradient_scaler_fsdp2(make: Callable[[nn.Module, dict], Any], has_inf: bool) -> dict:
    """``_test_gradient_scaler`` (1-D half): ``unscale_`` unscales the local shard and records
    ``found_inf`` on every rank (an Inf injected on rank 1 only), ``step`` skips or steps, ``update``
    backs off or keeps the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn([4, 4])
    current = {"x": x}
    scaler = make(model, current)
    if not scaler.is_enabled():
        return {"disabled": True}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler.scale(model(x).sum()).backward()
    # the first parameter's scale (per-group rules hold one per layer group; it is in group 0)
    inv_scale = scaler._scale.double().reciprocal().float().reshape(-1)[0]
    grad = opt.param_groups[0]["params"][0].grad
    if has_inf and dist.get_rank() == 1:
        grad._local_tensor[0, 0].fill_(float("inf"))
    initial_grad = grad.to_local().clone()
    scaler.unscale_(opt)
    found = [float(f) for f in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()]
    stage = scaler._per_optimizer_states[id(opt)]["stage"].value
    unscaled = opt.param_groups[0]["params"][0].grad.to_local().clone()
    initial_scale, initial_state = scaler.get_scale(), {k: dict(v) for k, v in opt.state.items()}
    first = scaler._scale.reshape(-1)[0].item()  # the first parameter's group (per-group rules)
    scaler.step(opt)
    stepped = {k: dict(v) for k, v in opt.state.items()} != initial_state
    scaler.update()
    return {"found": found, "stage": stage, "unscaled_ok": torch.equal(unscaled, initial_grad * inv_scale), "stepped": stepped,
            "scales": (initial_scale, scaler.get_scale()), "first": (first, scaler._scale.reshape(-1)[0].item()),
            "backoff": scaler.get_backoff_factor()}
