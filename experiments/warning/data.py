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

The natural workloads (``finetune``, ``rl``: ``conf/workload/``) have no setting that fails by
construction yet (``docs/early-warning.md`` says so); one would join as an entry of :data:`WORKLOADS`.
The scaler alternates with the seed (:func:`strategy_for`: ``native`` on even seeds, ``max_ema`` on
odd ones), so that each split holds both and the check stays ~10 min on one CPU thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.replay import runs
from experiments.replay.cli import load_trace
from strategies.tracing import Trace

__all__ = ["FAILED", "Run", "SEEDS", "STRATEGIES", "TRAIN_SEEDS", "WORKLOADS", "collect", "strategy_for"]

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
}
"""workload -> (overrides shared by both twins, the failing twin's learning rate); the healthy
twin runs at a tenth of it."""
STRATEGIES = ("native", "max_ema")
SEEDS = (0, 1, 2, 3)
TRAIN_SEEDS = (0, 1)
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

    @property
    def failed(self) -> bool:
        return self.status in FAILED

    @property
    def end(self) -> int:
        return self.trace.steps[-1]


def _lr(overrides: list[str], failing: bool) -> list[str]:
    (lr,) = [o for o in overrides if o.startswith("optimizer.lr=")]
    return [lr if failing else f"optimizer.lr={float(lr.split('=')[1]) / 10:g}"]


def strategy_for(seed: int) -> str:
    """The scaler of the runs of ``seed`` (module docstring)."""
    return STRATEGIES[seed % len(STRATEGIES)]


def collect(out: Path, workloads: list[str], seeds: tuple[int, ...] = SEEDS) -> list[Run]:
    """Train (or reuse) every labelled run and read its trace."""
    found = []
    for w in workloads:
        shared, lr = WORKLOADS[w]
        for seed in seeds:
            strategy = strategy_for(seed)
            for failing in (True, False):
                d = out / w / ("failing" if failing else "healthy") / strategy / f"seed{seed}"
                overrides = [*COMMON, *shared, *_lr(lr, failing), f"strategy={strategy}", f"seed={seed}"]
                trained = runs.finished(d, overrides) is None
                summary = runs.train(d, overrides)
                found.append(Run(w, strategy, seed, failing, summary["status"], load_trace(d), trained))
    return found
