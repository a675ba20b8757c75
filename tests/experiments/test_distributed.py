"""Data-parallel plumbing and the strategies' cross-rank agreement, on CPU with gloo.

The two-process tests start 2 ranks once per module (``torch.multiprocessing.spawn``, a
``file://`` rendezvous in tmp, so no port is needed) and run every registered strategy in them.
Under DDP the gradients are averaged inside ``backward()``, so a fault produced by backward
reaches every rank by itself. The case that needs the strategies' own all-reduce is a gradient
that differs *after* backward: the tests write an Inf (or a large finite spike) into rank 1's
gradient only. With ``distributed="auto"`` both ranks must skip the same step and keep bit-
identical parameters, optimizer state and scales; with ``distributed="off"`` (the control) the
ranks must disagree -- which shows the test can fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import strategies
from experiments.app import distributed as D
from experiments.app import gpu_slots
from experiments.workloads.models import MLP

WORLD = 2
STEPS = 7
INF_STEP = 2  # rank 1's gradient gets an Inf after backward
NAN_STEP = 3  # rank 0's gradient gets a NaN after backward
SPIKE_STEP = 6  # rank 1's gradient gets a finite x1000 spike (last step: parameters diverge after it)
# Strategy-specific keywords: norm_ratio probes its fp32 reference on every step here (default 50),
# so the reference path runs under DDP on the Inf and spike steps too.
EXTRA_KWARGS: dict[str, dict[str, Any]] = {"norm_ratio": {"probe_interval": 1}}


# ----------------------------------------------------------------------------- single process
def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)


def test_setup_single_process_has_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    info = D.setup(device="cpu")
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    assert info.device == torch.device("cpu") and info.backend is None and not info.distributed
    assert not torch.distributed.is_initialized()
    model = torch.nn.Linear(3, 2)
    assert D.wrap_model(model, info) is model
    x = torch.arange(12.0).reshape(6, 2)
    assert D.shard_batch(x, info) is x
    assert D.broadcast_object({"a": 1}, info) == {"a": 1}
    D.cleanup()  # no group: a no-op


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be in [0, 1]"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK must be >= 0"),
    ],
)
def test_setup_rejects_inconsistent_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    _clear_env(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        D.setup(device="cpu")


def test_setup_rejects_unknown_or_missing_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, cuda:N or cuda:free"):
        D.setup(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            D.setup(device="cuda")
        assert D.setup(device="auto").device == torch.device("cpu")


def test_rank_sharding_partitions_the_global_batch() -> None:
    x = torch.arange(24.0).reshape(8, 3)
    infos = [D.DistInfo(r, 4, r, torch.device("cpu"), r == 0, "gloo") for r in range(4)]
    shards = [D.shard_batch({"x": x, "y": (x[:, 0], x[:, 1])}, i) for i in infos]
    assert torch.equal(torch.cat([s["x"] for s in shards]), x)
    assert torch.equal(torch.cat([s["y"][1] for s in shards]), x[:, 1])
    with pytest.raises(ValueError, match="batch size must be divisible by world_size=4 to shard it, got 6"):
        D.shard_batch(x[:6], infos[0])
    # rank 0 draws what an undistributed run draws; other ranks draw a different stream
    assert D.rank_seed(7, 0) == 7 and len({D.rank_seed(7, r) for r in range(4)}) == 4


# ----------------------------------------------------------------------------- two processes
def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _opt_state(opt: torch.optim.Optimizer) -> torch.Tensor:
    return _flat(s["exp_avg"] for s in opt.state.values()) if opt.state else torch.zeros(0)


VARIANTS = ("auto", "nostats", "no_sync", "zero")
"""How the 2-rank runs differ: ``auto`` (DDP, statistics on), ``nostats`` (``track_stats=False``:
only found_inf is reduced), ``no_sync`` (``track_stats=False``, a first micro-batch accumulated under
DDP's ``no_sync()``), ``zero`` (``track_stats=False``, torch's ``ZeroRedundancyOptimizer``)."""


def _run_strategy(name: str, mode: str, info: D.DistInfo, variant: str = "auto") -> list[dict[str, Any]]:
    """STEPS training steps of a tiny DDP MLP under strategy ``name``; one record per step."""
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=4, width=16, depth=2)
    ddp = D.wrap_model(model, info)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2) if variant == "zero" \
        else torch.optim.Adam(model.parameters(), lr=1e-2)
    strat = strategies.create(
        name, init_scale=2.0**10, growth_interval=1, distributed=mode, track_stats=variant == "auto",
        **EXTRA_KWARGS.get(name, {})
    )
    strat.attach(model)
    gen = torch.Generator().manual_seed(D.rank_seed(1, info.rank))  # a different batch on each rank
    batch: dict[str, torch.Tensor] = {}

    def reference() -> torch.Tensor:  # norm_ratio's fp32 probe: on the plain module, not the DDP wrapper
        return F.cross_entropy(model(batch["x"]), batch["y"])

    strat.set_reference(reference, list(model.parameters()))
    records = []
    for step in range(STEPS):
        batch["x"], batch["y"] = _batch(gen)
        opt.zero_grad(set_to_none=True)
        if variant == "no_sync":  # a first micro-batch accumulated without DDP's all-reduce
            with ddp.no_sync():
                strat.scale(F.cross_entropy(ddp(batch["x"][:4]), batch["y"][:4])).backward()
        loss = F.cross_entropy(ddp(batch["x"]), batch["y"])
        strat.scale(loss).backward()
        if info.rank == 1 and step == INF_STEP:
            model.head.weight.grad[0, 0] = float("inf")
        if info.rank == 0 and step == NAN_STEP:
            model.layers[0][0].weight.grad[1, 2] = float("nan")
        if info.rank == 1 and step == SPIKE_STEP:
            model.head.weight.grad.mul_(1000.0)
        before = _flat(model.parameters())
        before_opt = _opt_state(opt)
        strat.step(opt)
        strat.update()
        tel = {k: v.detach().clone() for k, v in strat.telemetry().items()}
        records.append(
            {
                "params": _flat(model.parameters()),
                "opt_state": _opt_state(opt),
                "stepped": not torch.equal(before, _flat(model.parameters())),
                "opt_state_kept": torch.equal(before_opt, _opt_state(opt)),
                "scale": strat.get_scale(),
                "telemetry": tel,
            }
        )
    strat.detach()
    return records


def _worker(rank: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = D.setup(device="cpu", init_method=f"file://{tmp}/rendezvous")
    try:
        out: dict[str, Any] = {"info": (info.rank, info.world_size, info.local_rank, info.is_main, info.backend)}
        total = torch.tensor([rank, 10.0])
        torch.distributed.all_reduce(total)
        out["sum"] = total.tolist()
        out["broadcast"] = D.broadcast_object(f"dir-of-rank-{rank}", info)
        out["runs"] = {
            (name, mode, variant): _run_strategy(name, mode, info, variant)
            for name in strategies.available()
            for mode, variant in (("auto", "auto"), ("off", "auto"), *(("auto", v) for v in VARIANTS[1:]))
        }
        torch.distributed.barrier()
        torch.save(out, Path(tmp) / f"rank{rank}.pt")
    finally:
        D.cleanup(destroy=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp")
    torch.multiprocessing.spawn(_worker, args=(str(tmp),), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.distributed
def test_two_gloo_ranks_see_the_collectives(ranks: list[dict[str, Any]]) -> None:
    assert [r["info"] for r in ranks] == [(0, 2, 0, True, "gloo"), (1, 2, 1, False, "gloo")]
    assert [r["sum"] for r in ranks] == [[1.0, 20.0]] * 2
    assert [r["broadcast"] for r in ranks] == ["dir-of-rank-0"] * 2


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", strategies.available())
def test_inf_or_nan_on_one_rank_skips_the_step_on_both(ranks: list[dict[str, Any]], name: str, variant: str) -> None:
    """Also without statistics (``track_stats=False``: issue 29, the found_inf of empty statistics
    replaced the real one, so every rank stepped on the Inf), under ``no_sync`` and ZeRO."""
    r0, r1 = (r["runs"][(name, "auto", variant)] for r in ranks)
    for step in range(STEPS):
        a, b = r0[step], r1[step]
        assert a["scale"] == b["scale"], f"step {step}: scales differ {a['scale']} vs {b['scale']}"
        assert a["telemetry"].keys() == b["telemetry"].keys()
        for key in a["telemetry"]:
            if key.endswith("_time_s"):  # wall-clock timings are per process
                continue
            assert _same(a["telemetry"][key], b["telemetry"][key]), f"step {step}: telemetry {key!r} differs"
        if step < SPIKE_STEP:  # the spike changes rank 1's update, so parameters part after it
            assert torch.equal(a["params"], b["params"]), f"step {step}: parameters differ across ranks"
            if variant != "zero":  # ZeRO: each rank holds its own partition of the optimizer state
                assert torch.equal(a["opt_state"], b["opt_state"]), f"step {step}: optimizer state differs"
        expect_skip = step in (INF_STEP, NAN_STEP)
        assert a["stepped"] is b["stepped"] is (not expect_skip), f"step {step}: stepped {a['stepped']}/{b['stepped']}"
        if expect_skip:
            assert a["opt_state_kept"] and b["opt_state_kept"]
            assert a["telemetry"]["found_inf"].item() == 1.0
            prev = r0[step - 1]
            if "scales" in a["telemetry"]:  # per-group: the group where the fault arose backs off
                now, before = a["telemetry"]["scales"], prev["telemetry"]["scales"]
                assert bool((now <= before).all() and (now < before).any()), f"step {step}: {before} -> {now}"
            elif name == "static":  # a fixed scale by definition (issue 11): skipped, S kept
                assert a["scale"] == prev["scale"], "static must keep its scale"
            else:
                assert a["scale"] < prev["scale"], "a skipped step must back the scale off"
    assert r0[-1]["telemetry"]["skipped_steps"].item() == 2
    if variant != "auto" and not strategies.get(name).needs_stats:
        return
    # the finite spike (x1000 on rank 1) is in the agreed abs-max: statistics were reduced, not local
    spike, prev = r0[SPIKE_STEP]["telemetry"]["grad_absmax"], r0[SPIKE_STEP - 1]["telemetry"]["grad_absmax"]
    assert spike.item() > 100 * prev.item()


@pytest.mark.distributed
@pytest.mark.parametrize("name", strategies.available())
def test_without_all_reduce_the_ranks_disagree(ranks: list[dict[str, Any]], name: str) -> None:
    """Control: distributed="off" -- rank 0 steps on the Inf step, rank 1 skips; they part."""
    if name == "underflow_target":
        pytest.skip("underflow_target places S from each rank's own activation gradients every step (its "
                    "histogram is declared reduce='sum'): without the reduction its ranks part before the Inf step")
    r0, r1 = (r["runs"][(name, "off", "auto")] for r in ranks)
    assert torch.equal(r0[INF_STEP - 1]["params"], r1[INF_STEP - 1]["params"])  # DDP kept them equal so far
    assert r0[INF_STEP]["stepped"] and not r1[INF_STEP]["stepped"]
    assert not torch.equal(r0[INF_STEP]["params"], r1[INF_STEP]["params"])
    assert r0[INF_STEP]["telemetry"]["skipped_steps"].item() == 0
    assert r1[INF_STEP]["telemetry"]["skipped_steps"].item() == 1


def test_claim_slot_hands_out_each_gpu_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:free's lock: two GPUs, three claimants -- the third waits and times out; a release frees one."""
    a = gpu_slots.claim_slot(["0", "1"], tmp_path, timeout_s=0)
    b = gpu_slots.claim_slot(["0", "1"], tmp_path, timeout_s=0)
    assert (a[0], b[0]) == (0, 1)
    with pytest.raises(TimeoutError, match="no free GPU among 2"):
        gpu_slots.claim_slot(["0", "1"], tmp_path, timeout_s=0.2, poll_s=0.05)
    os.close(b[1])
    c = gpu_slots.claim_slot(["0", "1"], tmp_path, timeout_s=0)
    assert c[0] == 1
    for _, fd in (a, c):
        os.close(fd)
    _clear_env(monkeypatch)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, cuda:N or cuda:free, got 'cpu:1'"):
        D.setup(device="cpu:1")


def _submitit_task() -> tuple[int, int, int, float]:
    torch.set_num_threads(1)
    info = D.setup(device="cpu")
    try:
        total = torch.tensor(float(info.rank + 1))
        torch.distributed.all_reduce(total)
        return info.rank, info.world_size, info.local_rank, total.item()
    finally:
        D.cleanup(destroy=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_submitit_tasks_form_one_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submitit job with tasks_per_node=2 (hydra/launcher=slurm with tasks_per_node=2 on a
    cluster) becomes a 2-rank group without torchrun: setup() reads submitit's job environment."""
    submitit = pytest.importorskip("submitit")
    _clear_env(monkeypatch)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    executor = submitit.LocalExecutor(folder=tmp_path / "%j")
    executor.update_parameters(tasks_per_node=2, timeout_min=5)
    job = executor.submit(_submitit_task)
    assert sorted(job.results()) == [(0, 2, 0, 3.0), (1, 2, 1, 3.0)]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks_match_one_process(tmp_path: Path) -> None:
    """`torchrun --nproc_per_node=2 -m experiments.app.train -m strategy=native,max_ema` (DDP, gloo):
    each rank trains on half of the same global batch and DDP averages the gradients, so the native
    job matches a one-process run on the whole batch up to summation order; only rank 0 writes the
    run record; the second job of the sweep reuses the process group (re-creating it hangs)."""
    import json
    import subprocess
    import sys

    from tests.experiments.runs import QUIET, REPO, TINY, cli

    args = [*TINY["gpt"], *QUIET, "precision=fp32", "train.steps=8", "train.log_every=2",
            "train.eval_every=0", "train.checkpoint_every=0"]
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "experiments.app.train",
         "-m", "strategy=native,max_ema", *args, f"hydra.sweep.dir={tmp_path / 'ddp'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = cli("strategy=native", *args, f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-3000:]

    def record(run_dir: Path) -> tuple[list[dict], dict]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "train"], json.loads((run_dir / "summary.json").read_text())

    (ddp_rows, ddp_sum), (one_rows, one_sum) = record(tmp_path / "ddp" / "0"), record(tmp_path / "single")
    assert ddp_sum["status"] == one_sum["status"] == "completed"
    assert [r["step"] for r in ddp_rows] == [r["step"] for r in one_rows] == [2, 4, 6, 8]  # one writer, no duplicates
    assert [r["scale"] for r in ddp_rows] == [r["scale"] for r in one_rows]
    for a, b in zip(ddp_rows, one_rows):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert ddp_sum["final_eval_loss"] == pytest.approx(one_sum["final_eval_loss"], rel=1e-4)
    second = record(tmp_path / "ddp" / "1")[1]
    assert (second["status"], second["strategy"]) == ("completed", "max_ema")


def test_gpu_choice_per_rank_without_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Device arithmetic with CUDA faked (no GPU is touched): one GPU per local rank; a rank that
    sees one device (scheduler-bound) takes cuda:0; more ranks than GPUs is an error; cuda:free
    hands this process a GPU no other process holds and keeps it until cleanup()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("SCALELAB_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D._resolve_device("cuda", local_rank=1, world_size=2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"GPU index 2 \(local rank 2\) is out of range: 2 visible"):
        D._resolve_device("cuda", local_rank=2, world_size=3)
    with pytest.raises(ValueError, match="names one GPU, but world_size=2"):
        D._resolve_device("cuda:1", local_rank=0, world_size=2)
    other = gpu_slots.claim_slot(["5"], tmp_path, timeout_s=0)  # another process holds physical GPU 5
    assert D._resolve_device("cuda:free", local_rank=0, world_size=1) == torch.device("cuda", 1)
    assert D._resolve_device("cuda:free", local_rank=0, world_size=1) == torch.device("cuda", 1)  # kept
    D.cleanup()
    os.close(other[1])
    assert D._resolve_device("cuda:free", local_rank=0, world_size=1) == torch.device("cuda", 0)
    D.cleanup()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert D._resolve_device("cuda", local_rank=3, world_size=4) == torch.device("cuda", 0)
