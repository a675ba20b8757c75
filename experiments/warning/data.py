"""The labelled runs of the early warning: workloads that fail by construction and their healthy
twins (the same run with the fix: a tenth of the learning rate), per strategy and seed.

* ``logit_growth`` — attention-logit growth at a high learning rate (Wortsman et al. 2023;
  ``conf/model/gpt_logit_growth.yaml``): lr 0.1 diverges at ~step 120 of 200 in fp16;
* ``ffn_overflow`` — an FFN whose output passes 65504 in the fp16 forward as the learning rate warms
  up (``conf/model/gpt_ffn_overflow.yaml`` with ``ffn_gain`` 700, lr 0.1): diverges at ~step 35;
* ``lr_spike`` — a fast warm-up to a high peak (``conf/experiment/doctor_lr_spike.yaml`` at lr 1.0
  over 60 steps): diverges at ~step 50 (a forward overflow at the peak);
* ``fp8_lr_spike`` — the same in ``fp8_e5m2`` (bf16 forward, e5m2 activation gradients): the
  loss passes ``train.divergence_loss`` at ~step 60.

* ``finetune_lr_spike`` — the natural fine-tuning workload (``conf/workload/finetune.yaml``: the
  pretrained character GPT on held-out text) warmed up over 60 steps to lr 1.0: diverges at
  ~step 65-85 (a forward overflow in ``blocks.0.fc_out``, as the doctor says);
* ``scale_floor`` — ``lr_spike`` under ``native`` with ``min_scale`` 16384 and ``on_min_scale: raise``:
  the scale pinned at its floor stops the run (``failed``) at ~step 44, unless the loss diverges first.

The ``rl`` workload (GRPO, ``conf/workload/rl.yaml``) has no setting found that fails by construction:
``scalelab-train +workload=rl strategy=native seed=0 optimizer.lr=L train.lr_warmup=60 train.steps=150
train.grad_clip=0`` completed with no skipped step at L = 0.3 and 1.0 (and at 200 steps with L = 3e-3,
3e-2): its clipped surrogate loss stays bounded, so neither the loss nor the scale fails; a collapse
of its reward is not a run status. The scaler alternates with the seed (:func:`strategy_for`:
``native`` on even seeds, ``max_ema`` on odd ones; :data:`PINNED` workloads keep one), so that each
split holds both. Seeds 0-7: the detector is fitted on :data:`TRAIN_SEEDS` (0-3) and evaluated on
4-7, 8 workload twins x 6 workloads = 48 runs on each side.

Harder negatives (:data:`NEAR`): every seed again at a third of the failing learning rate
(``<out>/<workload>/near/<strategy>/seed<k>``), closer to the edge than the healthy twins: most
stay healthy (some skip steps on the way), a few fail. Those of the training seeds are fitted on
with the twins; those of the held-out seeds are only evaluated.

The CPU time of each run trained here (this process's ``time.process_time`` around it) is kept in
``<out>/costs.json`` (:data:`COSTS`), so that a later command reusing the runs still states what
the data cost.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.replay import runs
from experiments.replay.cli import load_trace
from strategies.tracing import Trace

__all__ = ["COSTS", "FAILED", "NEAR", "Run", "SEEDS", "STRATEGIES", "TRAIN_SEEDS", "WORKLOADS", "collect", "overrides",
           "strategy_for"]

COMMON = ["logger=none", "train.progress=false", "threads=1", "train.log_every=5", "train.hist_every=0",
          "train.fidelity_every=0", "train.checkpoint_every=0", "train.eval_every=0", "train.eval_batches=1"]
GPT = ["model.n_embd=64", "data.block_size=32", "train.batch_size=16"]
LR_SPIKE = ["+experiment=doctor_lr_spike", "train.lr_warmup=60", "train.steps=100", "train.log_every=5", *GPT]
WORKLOADS: dict[str, tuple[list[str], list[str]]] = {
    "logit_growth": (["model=gpt_logit_growth", *GPT, "optimizer.weight_decay=0", "train.grad_clip=0", "train.steps=200"],
                     ["optimizer.lr=0.1"]),
    "ffn_overflow": (["model=gpt_ffn_overflow", "model.ffn_gain=700", *GPT, "optimizer.weight_decay=0",
                      "train.grad_clip=0", "train.lr_warmup=50", "train.steps=150"], ["optimizer.lr=0.1"]),
    "lr_spike": (LR_SPIKE, ["optimizer.lr=1.0"]),
    "fp8_lr_spike": ([*LR_SPIKE, "precision=fp8_e5m2"], ["optimizer.lr=1.0"]),
    "finetune_lr_spike": (["+workload=finetune", "train.lr_warmup=60", "train.steps=150", "train.grad_clip=0"],
                          ["optimizer.lr=1.0"]),
    "scale_floor": ([*LR_SPIKE, "strategy.min_scale=16384", "strategy.on_min_scale=raise"], ["optimizer.lr=1.0"]),
}
"""workload -> (overrides shared by both twins, the failing twin's learning rate); the healthy
twin runs at a tenth of it."""
STRATEGIES = ("native", "max_ema")
PINNED = {"scale_floor": "native"}
"""Workloads run with one strategy on every seed (``scale_floor``: ``native``'s ``on_min_scale``)."""
SEEDS = tuple(range(8))
TRAIN_SEEDS = (0, 1, 2, 3)
NEAR = 3
"""The near-edge healthy runs train at the failing learning rate over this (the healthy twins: over 10)."""
COSTS = "costs.json"
"""``{run directory relative to out: {"cpu_s", "wall_s"}}`` of the runs as they were trained."""
FAILED = ("diverged", "stalled", "failed")


@dataclass
class Run:
    """One labelled run: its trace, whether it failed, and where (its last step)."""

    workload: str
    strategy: str
    seed: int
    failing: bool
    status: str
    trace: Trace
    trained: bool = False
    """Trained by this command (else reused from an earlier one)."""
    cpu_s: float | None = None
    """CPU seconds its training took (when it was trained; None: not known)."""
    near: bool = False
    """A near-edge run (:data:`NEAR`; ``failing`` is then False)."""

    @property
    def failed(self) -> bool:
        return self.status in FAILED

    @property
    def end(self) -> int:
        return self.trace.steps[-1]


ROLES = {"failing": 1, "healthy": 10, "near": NEAR}
"""A run's role (its directory) -> what its learning rate is the failing one divided by."""


def overrides(workload: str, seed: int, role: str) -> list[str]:
    """The ``scalelab-train`` overrides of one labelled run (``role``: a key of :data:`ROLES`)."""
    shared, lr = WORKLOADS[workload]
    (rate,) = [o for o in lr if o.startswith("optimizer.lr=")]
    rate = f"optimizer.lr={float(rate.split('=')[1]) / ROLES[role]:g}" if ROLES[role] != 1 else rate
    return [*COMMON, *shared, rate, f"strategy={strategy_for(seed, workload)}", f"seed={seed}"]


def strategy_for(seed: int, workload: str | None = None) -> str:
    """The scaler of ``workload``'s runs of ``seed`` (module docstring; :data:`PINNED`)."""
    return PINNED.get(workload or "", STRATEGIES[seed % len(STRATEGIES)])


def collect(out: Path, workloads: list[str], seeds: tuple[int, ...] = SEEDS, near: bool = False) -> list[Run]:
    """Train (or reuse) every labelled run and read its trace: the failing and healthy twins, or
    (``near``) the near-edge runs."""
    found = []
    try:
        costs = json.loads((out / COSTS).read_text())
    except (OSError, ValueError):
        costs = {}
    for w in workloads:
        for seed in seeds:
            strategy = strategy_for(seed, w)
            for role in ("near",) if near else ("failing", "healthy"):
                d = out / w / role / strategy / f"seed{seed}"
                args = overrides(w, seed, role)
                trained = runs.finished(d, args) is None
                cpu0, t0 = time.process_time(), time.perf_counter()
                summary = runs.train(d, args)
                key = str(d.relative_to(out))
                if trained:
                    costs[key] = {"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - t0}
                    out.mkdir(parents=True, exist_ok=True)
                    (out / COSTS).write_text(json.dumps(costs, indent=1, sort_keys=True))
                cpu = costs.get(key, {}).get("cpu_s")
                found.append(Run(w, strategy, seed, role == "failing", summary["status"], load_trace(d), trained, cpu,
                                 near=role == "near"))
    return found
