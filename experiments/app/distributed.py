"""Data-parallel plumbing for the training app: process group, device, DDP wrap, seeding, sharding.

One process per device. ``setup()`` reads the rank layout that the launcher put in the
environment and joins the process group; everything else here is a small helper the training
loop calls so that the same code runs unchanged as one process on a laptop CPU, as
``torchrun --nproc_per_node=N`` on a multi-GPU host, or as N submitit/SLURM tasks.

Where the rank layout comes from, first match wins:

1. torchrun (``torch.distributed.run``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and
   ``MASTER_ADDR``/``MASTER_PORT`` for the default ``env://`` rendezvous).
2. A submitit job with more than one task (``hydra/launcher=slurm`` or ``slurm_local`` with
   ``hydra.launcher.tasks_per_node > 1``): the task's global rank, task count and local
   rank from ``submitit.JobEnvironment``; the master address is the job's first host and the
   port is derived from the job id, as ``submitit.helpers.TorchDistributedEnvironment`` does.
3. Nothing set: a single process, ``world_size == 1``, no process group.

Backend: ``nccl`` when the device is CUDA, ``gloo`` on CPU. Device: one GPU per local rank
(``cuda:LOCAL_RANK``); with ``CUDA_VISIBLE_DEVICES`` restricted to one GPU (SLURM's
``gpus_per_task=1``) that is ``cuda:0``, the only visible device. For several single-process jobs
sharing a multi-GPU host (the joblib launcher, or several sweeps at once), ``device="cuda:free"``
gives each job a GPU no other job holds, by an exclusive lock file per GPU (``experiments/app/gpu_slots.py``).

Loss-scaling consistency. Under DDP the gradients are averaged across ranks during
``backward()``, so a non-finite value produced in backward reaches every rank. What DDP does
*not* synchronise is anything that happens to a rank's gradients after backward (clipping
hooks, a fault, a test's injection) and the strategies' own statistics (found_inf, abs-max,
sums of squares, counts, per group). Strategies all-reduce those when ``distributed`` is
``"auto"``/``"replicated"``/``"sharded"`` and a process group is initialised (see
``docs/strategy-api.md`` and ``strategies/base.py``): ``found_inf`` and ``absmax`` by MAX -- the
"global_max = max(all_reduce(local_max))" rule of the design source (seed 003, section 4.5) --
and, for replicated (DDP) gradients, the sums and counts by MAX as well (replicas agree), for
sharded ones by SUM. It is done on every rank instead of computed on rank 0 and broadcast, so all
ranks take the same skip and scale decision with one collective and no host sync.

The process group lives as long as the process: ``cleanup()`` keeps it for the next job of a
sweep (Hydra runs a multirun's jobs in one process) and it is destroyed at exit.
"""

from __future__ import annotations

import atexit
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from experiments.app import gpu_slots
from strategies.model_layers import layers

__all__ = [
    "DistInfo",
    "setup",
    "cleanup",
    "wrap_model",
    "is_sharded",
    "full_state",
    "load_full_state",
    "seed_everything",
    "rank_seed",
    "shard_batch",
    "broadcast_object",
]

T = TypeVar("T")

DEVICES = ("auto", "cpu", "cuda")

@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the data-parallel job.

    ``rank`` is the global rank in ``[0, world_size)``, ``local_rank`` the rank on this host
    (it picks the GPU), ``device`` the device this process trains on, ``is_main`` is
    ``rank == 0`` -- the one process that writes run records, checkpoints and W&B logs.
    ``backend`` is the process-group backend, or ``None`` for a single process.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        """True when more than one process trains (a process group is initialised)."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _submitit_layout() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) of a multi-task submitit job, exporting MASTER_ADDR/PORT.

    Returns ``None`` outside submitit or for single-task jobs (the common one-GPU-per-job case).
    The rendezvous follows ``submitit.helpers.TorchDistributedEnvironment``: first host of the
    job, a port in [20000, 60000] drawn from ``random.Random(job_id)`` unless MASTER_PORT is set.
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    try:
        import submitit  # optional dependency (the submitit launcher extra): only inside a submitit job
    except ImportError:  # pragma: no cover - submitit sets the variable, so it is installed
        return None
    job_env = submitit.JobEnvironment()
    if job_env.num_tasks <= 1:
        return None
    os.environ.setdefault("MASTER_ADDR", job_env.hostnames[0])
    os.environ.setdefault("MASTER_PORT", str(random.Random(job_env.job_id).randint(20000, 60000)))
    return job_env.global_rank, job_env.num_tasks, job_env.local_rank


def _resolve_device(device: str, local_rank: int, world_size: int, gpu_wait_s: float = 86400.0) -> torch.device:
    """``auto`` -> CUDA if available else CPU; ``cuda`` -> ``cuda:local_rank`` (one GPU per rank;
    ``cuda:0`` when the rank sees a single device);
    ``cuda:N`` -> that GPU; ``cuda:free`` -> a GPU no other scalelab process on this host holds."""
    kind = device.split(":", 1)[0]
    if kind not in DEVICES or (kind != "cuda" and ":" in device):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, cuda:N or cuda:free, got {device!r}")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device=cpu or device=auto")
    count = torch.cuda.device_count()
    if ":" in device:
        if world_size > 1:
            raise ValueError(
                f"device={device!r} names one GPU, but world_size={world_size}: use device=cuda, "
                "each rank then takes cuda:LOCAL_RANK"
            )
        which = device.split(":", 1)[1]
        if which == "free":
            return torch.device("cuda", gpu_slots.claim_free_gpu(gpu_wait_s))
        if not which.isdigit():
            raise ValueError(f"device must be cuda, cuda:N or cuda:free, got {device!r}")
        index = int(which)
    else:
        # One GPU per local rank. A scheduler that binds a GPU to each task (SLURM with
        # --gpus-per-task=1 and per-task binding) leaves every rank exactly one visible device.
        index = 0 if count == 1 else local_rank
    if not 0 <= index < count:
        raise ValueError(
            f"GPU index {index} (local rank {local_rank}) is out of range: {count} visible CUDA "
            f"device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); "
            "start at most one process per visible GPU"
        )
    return torch.device("cuda", index)


def setup(
    device: str = "auto",
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float = 1800.0,
    gpu_wait_s: float = 86400.0,
) -> DistInfo:
    """Read the rank layout from the environment, pick the device, join the process group.

    Args:
        device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` (``cuda:LOCAL_RANK``),
            ``cuda:N`` (single process only), or ``cuda:free`` (single process only): claim a
            GPU that no other scalelab process on this host holds, waiting up to ``gpu_wait_s``
            for one -- exclusive one-GPU-per-job with the joblib launcher or several sweeps.
        backend: process-group backend; default ``nccl`` on CUDA, ``gloo`` on CPU.
        init_method: rendezvous URL; default ``env://`` (MASTER_ADDR/MASTER_PORT, set by
            torchrun and by the submitit path). Tests pass ``file://...``.
        timeout_s: collective timeout.
        gpu_wait_s: how long ``cuda:free`` waits for a GPU before ``TimeoutError``.

    Returns:
        A ``DistInfo``. With ``world_size == 1`` no process group is created, so strategies
        with ``distributed="auto"`` stay local. Calling ``setup`` again when the group is
        already initialised reuses it.

    Raises:
        ValueError: inconsistent RANK/WORLD_SIZE/LOCAL_RANK, unknown device, CUDA requested but
            missing, or more ranks on this host than visible GPUs.
    """
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", rank)
    else:
        layout = _submitit_layout()
        rank, world_size, local_rank = layout if layout is not None else (0, 1, 0)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, {world_size - 1}] (WORLD_SIZE={world_size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local_rank}")

    dev = _resolve_device(device, local_rank, world_size, gpu_wait_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    used_backend: str | None = None
    if world_size > 1:
        used_backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(
                backend=used_backend,
                init_method=init_method or "env://",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            atexit.register(_destroy_group)
        elif dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"a process group is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {rank} of {world_size}"
            )
        used_backend = str(dist.get_backend())
    return DistInfo(rank, world_size, local_rank, dev, rank == 0, used_backend)


def _destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def cleanup(destroy: bool = False) -> None:
    """End of a run: release a ``cuda:free`` GPU claim; with ``destroy=True`` also leave the
    process group. Call it at the end of every run, also when it fails (``try/finally``).

    By default the process group stays up for the process's next run and is destroyed at exit.
    Under ``torchrun ... -m experiments.app.train -m a,b`` every rank runs the jobs of the sweep one
    after another in one process; destroying the default group and creating it again between
    jobs hangs: torch resets its group counter on destroy, so the new group's gloo/NCCL
    rendezvous reuses the old group's store keys and a rank that arrives first can read its peer's
    stale address. ``setup()`` of the next job reuses the live group instead.
    """
    if destroy:
        _destroy_group()
    gpu_slots.release_gpu()


def wrap_model(model: nn.Module, info: DistInfo, mode: str = "ddp", **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to ``info.device`` and, when ``world_size > 1``, spread it over the ranks.

    A single process gets the model back unchanged (only moved). ``mode="ddp"``: wrapped in DDP,
    which broadcasts rank 0's parameters and buffers at construction, so all ranks start identical
    even if their initialisation seeds differ; ``ddp_kwargs`` go to ``DistributedDataParallel``.
    Attach hooks that must see the plain module (``layerwise``'s ``attach``) and build the
    ``norm_ratio`` fp32 reference closure on the plain model (``model.module`` under DDP): a forward
    through the DDP wrapper arms its gradient reducer, which ``torch.autograd.grad`` never fires.

    ``mode="fsdp2"`` (torchtitan's recipe): ``fully_shard`` on each of the model's layers that owns
    parameters (:func:`strategies.model_layers.layers`: its declared ``boundaries``, else its
    repeated blocks), then on the root; the model is changed in place (its parameters become DTensor shards, the same
    initial values on every rank: the init is seeded alike) and returned. The strategies detect the
    sharded gradients (``distributed="auto"``); attach and the reference closure take this model.
    """
    model = model.to(info.device)
    if not info.distributed:
        return model
    if mode == "fsdp2":
        for name in layers(model):
            layer = model.get_submodule(name)
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's ``state_dict`` as one process would hold them: under FSDP2
    gathered from the shards into full CPU tensors (a collective: every rank calls it), else theirs."""
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=full), get_optimizer_state_dict(model, optimizer, options=full)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Inverse of :func:`full_state` (every rank holds the full state dicts, read from the checkpoint)."""
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    set_optimizer_state_dict(model, optimizer, optim_state, options=full)


def rank_seed(seed: int, rank: int) -> int:
    """Seed for rank-local randomness (data order, dropout): ``seed + 1_000_003 * rank``.

    Rank 0 keeps ``seed``, so a one-process run draws exactly what an undistributed run draws.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return seed + 1_000_003 * rank


def seed_everything(seed: int, info: DistInfo | None = None, per_rank: bool = False) -> int:
    """Seed ``random``, NumPy and torch (CPU and all CUDA devices); return the seed used.

    ``per_rank=False`` (model initialisation): every rank uses ``seed``.
    ``per_rank=True`` (data order, dropout): rank r uses ``rank_seed(seed, r)``.
    """
    used = rank_seed(seed, info.rank if (per_rank and info is not None) else 0)
    random.seed(used)
    np.random.seed(used % 2**32)
    torch.manual_seed(used)
    return used


def shard_batch(batch: T, info: DistInfo) -> T:
    """This rank's slice of a *global* batch (tensor, or tuple/list/dict of tensors, split on dim 0).

    Every rank draws the same global batch (same generator seed) and keeps rows
    ``[rank * B/W, (rank + 1) * B/W)``. With DDP's gradient averaging the update then equals the
    single-process update on the whole batch (up to floating-point summation order).

    Raises:
        ValueError: the batch size is not divisible by ``world_size``.
    """
    if not info.distributed:
        return batch
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0]
        if n % info.world_size:
            raise ValueError(
                f"batch size must be divisible by world_size={info.world_size} to shard it, got {n}"
            )
        per = n // info.world_size
        return batch[info.rank * per : (info.rank + 1) * per]  # type: ignore[return-value]
    if isinstance(batch, dict):
        return {k: shard_batch(v, info) for k, v in batch.items()}  # type: ignore[return-value]
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_batch(v, info) for v in batch)  # type: ignore[return-value]
    raise TypeError(f"shard_batch takes a tensor or a tuple/list/dict of tensors, got {type(batch).__name__}")


def broadcast_object(obj: T, info: DistInfo, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (pickled); identity for one process.

    Use it for values that must agree but are computed per process, e.g. the output directory
    (each torchrun rank runs Hydra and stamps its own ``${now:...}``).
    """
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
