"""``make replay-check``: is a replay what a real run would have done? (``docs/replay.md``)

For each workload where rules act (overflow: ``spikes``; underflow: ``tiny_grad``), each seed and
each *source* rule (``native``, ``max_ema``),
every strategy option is (a) replayed on the source run's trace and (b) trained for real on the
same seed. Per pair, over the steps both runs have:

* ``first diff`` — the first step where the replay's skip decision differs from the real run's;
  from there on the real run's weights, hence its gradients, are not the recorded ones;
* ``within 2x`` — the share of steps before it whose replayed (loss-side) scale is within a factor
  of 2 of the real one (target: 95%), and the same share after it;
* ``useful after`` — how many steps past the first difference the replayed scale stays within 2x;
* skipped steps, replayed and real.

Runs go to ``runs/replay_check/<workload>/<option>/seed<k>`` (reused when finished); the results
to ``results.json`` there and the page to ``docs/replay.md``
(:mod:`experiments.replay.check_page`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import mean
from typing import Any

from experiments import schema
from experiments.replay import check_page, presets, runs
from experiments.replay.cli import load_trace
from strategies.tracing import Trace, replay
from strategies.tracing.inputs import OVERFLOW_MODELS, unreplayable
from strategies.tracing.replay import ReplayResult

__all__ = ["BASE", "SEEDS", "SOURCES", "WORKLOADS", "agreement", "court_pairs", "main"]

BASE = ["+experiment=stress", "train.steps=150", "train.log_every=5", "train.hist_every=5", "train.fidelity_every=0",
        "train.checkpoint_every=0", "train.eval_every=0", "train.eval_batches=1", "logger=none", "train.progress=false",
        "threads=1"]
WORKLOADS: dict[str, list[str]] = {
    "spikes": ["regime=spikes", "regime.spike_steps=[30,60,90,120]"],
    "tiny_grad": ["regime=tiny_grad"],
}
"""The stress grid's character GPT (``conf/experiment/stress.yaml``: 2 layers, width 32, fp16) 150
steps long: the loss x 1e4 at steps 30, 60, 90 and 120 (overflow); the loss x 1e-8 (underflow)."""
SOURCES = ("native", "max_ema")
SEEDS = (0,)


def agreement(pred: ReplayResult, real: Trace) -> dict[str, Any]:
    """The pair's numbers (module docstring), over the steps both have."""
    n = min(len(pred.steps), len(real))
    s_pred, s_real = [p.scale for p in pred.steps[:n]], [row[-1] for row in real.scale[:n]]
    k_pred, k_real = [p.skipped for p in pred.steps[:n]], real.found_inf[:n]
    d = next((i for i in range(n) if k_pred[i] != k_real[i]), n)
    within = [a > 0 and b > 0 and max(a / b, b / a) <= 2 for a, b in zip(s_pred, s_real)]  # a scale of 0: never
    useful = next((j for j in range(d, n) if not within[j]), n) - d
    return {"steps": n, "first_diff": real.steps[d] if d < n else None,
            "within_before": mean(within[:d]) if d else None, "within_after": mean(within[d:]) if d < n else None,
            "useful_after": useful if d < n else None, "skipped_replay": sum(k_pred), "skipped_real": sum(k_real)}


def _overrides(workload: str, option: str, seed: int) -> list[str]:
    return [*BASE, *WORKLOADS[workload], f"strategy={option}", f"seed={seed}"]


def _train_all(out: Path, workloads: list[str], seeds: tuple[int, ...], options: list[str]) -> dict[tuple, Path]:
    dirs = {}
    for w in workloads:
        for seed in seeds:
            for option in options:
                run_dir = out / w / option / f"seed{seed}"
                runs.train(run_dir, _overrides(w, option, seed))
                dirs[w, option, seed] = run_dir
    return dirs


def _pairs(dirs: dict[tuple, Path], workloads: list[str], seeds: tuple[int, ...], options: list[str]) -> list[dict]:
    rows = []
    for w in workloads:
        for seed in seeds:
            for source in SOURCES:
                trace = load_trace(dirs[w, source, seed])
                for option in options:
                    real = load_trace(dirs[w, option, seed])
                    row = {"workload": w, "seed": seed, "source": source, "target": option}
                    for model in OVERFLOW_MODELS:
                        strategy = presets.build(option, trace.format.name)
                        t0 = time.perf_counter()
                        result = replay(trace, strategy, overflow=model)
                        row[model] = {**agreement(result, real), "seconds": time.perf_counter() - t0}
                    rows.append(row)
    return rows


def court_pairs(root: Path, seeds: tuple[int, ...]) -> list[dict]:
    """The court's natural runs (``make court``: ``ROOT/<rl|finetune>/fp16-<option>/seed<k>``): every
    preset cell's trace replayed as every other cell's preset, against that cell's real run of the seed,
    under each overflow model (the rows of :func:`_pairs`)."""
    rows = []
    for w in ("rl", "finetune"):
        cells = sorted(d.name[len("fp16-"):] for d in (root / w).glob("fp16-*") if d.name[len("fp16-"):] in presets.options())
        for seed in seeds:
            traces = {c: load_trace(root / w / f"fp16-{c}" / f"seed{seed}") for c in cells}
            for source, trace in traces.items():
                for option, real in traces.items():
                    row = {"workload": w, "seed": seed, "source": source, "target": option}
                    for model in OVERFLOW_MODELS:
                        row[model] = agreement(replay(trace, presets.build(option, "fp16"), overflow=model), real)
                    rows.append(row)
    return rows


def _sizes(dirs: dict[tuple, Path]) -> list[dict]:
    """Bytes of ``trace.jsonl`` per step, measured on the check's runs."""
    out = []
    for (w, option, seed), d in sorted(dirs.items()):
        trace = load_trace(d)
        out.append({"workload": w, "target": option, "seed": seed, "steps": len(trace),
                    "bytes": (d / schema.TRACE_NAME).stat().st_size, "groups": len(trace.groups),
                    "scale_groups": len(trace.scale_groups), "histograms": len(trace.histograms)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.replay.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/replay_check"))
    p.add_argument("--page", type=Path, default=Path("docs/replay.md"))
    p.add_argument("--quick", action="store_true", help="one workload, four options (a smoke run)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (default: %(default)s)")
    p.add_argument("--court", type=Path, default=Path("runs/court"), help="make court's runs, for the overflow "
                   "models on natural runs (default: %(default)s; skipped when absent)")
    p.add_argument("--court-seeds", type=int, nargs="+", default=[0], help="their seeds (default: %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    workloads, seeds = (["spikes"] if args.quick else list(WORKLOADS)), tuple(args.seeds)
    replayable, missing = [], {}
    for option in presets.options():
        reason = unreplayable(presets.build(option))
        if reason is None:
            replayable.append(option)
        else:
            missing[option] = reason
    options = ["native", "max_ema", "megatron", "underflow_target"] if args.quick else replayable
    before = sum(1 for w in workloads for o in options for k in seeds
                 if runs.finished(args.out / w / o / f"seed{k}", _overrides(w, o, k)))
    dirs = _train_all(args.out, workloads, seeds, options)
    rows = _pairs(dirs, workloads, seeds, options)
    court = court_pairs(args.court, tuple(args.court_seeds)) if (args.court / "rl").is_dir() else []
    results = {"rows": rows, "court": court, "court_dir": str(args.court), "court_seeds": list(args.court_seeds), "missing": missing, "sizes": _sizes(dirs), "workloads": {w: WORKLOADS[w] for w in workloads},
               "base": BASE, "seeds": list(seeds), "sources": list(SOURCES), "minutes": (time.perf_counter() - t0) / 60,
               "trained": len(dirs) - before, "runs": len(dirs)}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    check_page.write(args.page, results)
    print(f"replay-check: {len(rows)} pairs in {results['minutes']:.1f} min; {args.page} written")


if __name__ == "__main__":
    main()
