"""``scalelab-bench``: what scaling costs per step, and what the fused statistics pass costs.

(a) **Per-step strategy overhead** — ``scale(loss)`` + ``unscale_(opt)`` + ``step(opt)`` +
``update()``, with an optimizer whose ``step`` does nothing, so forward, backward and the
optimizer's arithmetic are excluded — for every registered strategy (``strategies.available()``),
for ``torch.amp.GradScaler("cpu")`` and for no scaling (``loss`` + ``opt.step()``), at each size.
``norm_ratio`` runs without a reference closure, i.e. its overhead *excluding the probe* (the
probe is one fp32 forward+backward every ``probe_interval`` steps, a model-dependent cost that
the training runs record). ``layerwise`` runs unattached (one group), with its default rule and
as ``layerwise_adaloss`` (``rule: adaloss``, :data:`experiments.bench.common.VARIANTS`).

(c) the attach cost per training step of the attach-based rules (their hooks, and AdaLoss's weight
statistics), (d) what a fused AdamW saves and (e) the attached rules' cost against ``stats_every``:
:mod:`experiments.bench.steps`; (c2) the hooks' host cost on a model where nothing hides it:
:mod:`experiments.bench.hook_host`; (c3) the layer-boundary ops against plain torch:
:mod:`experiments.bench.boundary_ops`.

(b) **Statistics pass** — ``strategies.stats.unscale_and_stats`` (the fused op when built) versus
one in-place ``torch._foreach_mul_`` over the same gradients (the floor: one read + one write),
versus GradScaler's own unscale (``torch._amp_foreach_non_finite_check_and_unscale_``, no statistics)
and versus the plain-torch multi-pass reference ``unscale_and_stats_reference``.

Everything is measured side by side in one process: each repeat runs every configuration once
(round robin, so load changes hit all alike), gradients are restored from a master copy outside
the timed region before every timed call (so repeated unscaling never drifts into subnormals),
and the table reports medians over the repeats; each ratio is the median of per-round ratios (rounds in a shuffled order). Results go to ``--out`` (JSON).

``--device cuda`` runs the GPU section instead (:mod:`experiments.bench.gpu`: the statistics
pass's GB/s against ``_foreach_mul_`` and GradScaler's unscale for fp16/bf16/fp32, and every
rule's full step against ``torch.amp.GradScaler("cuda")``, timed with CUDA events) and writes
the generated page ``docs/bench.md`` (``--write-docs PATH``, ``--no-docs``). The default stays
``cpu``, so a plain run means the same thing on every machine; on the CPU ``--write-docs PATH``
writes the printed tables as a page (``make bench``: ``docs/bench-cpu.md``), so no commit re-types them.

Example::

    scalelab-bench                         # sizes 1M,10M,50M, 7 repeats
    scalelab-bench --quick                 # 1M only, 3 repeats: a smoke run
    scalelab-bench --sizes 50M --repeats 11 --out bench50m.json
    scalelab-bench --device cuda           # GPU: 10M,30M,100M x fp16,bf16,fp32; steps at 10M,100M
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path
import time
from datetime import datetime, timezone
from typing import Any, Callable

import torch

import strategies
from experiments.app.records import write_text_atomic
from experiments.bench import boundary_ops, gpu as bench_gpu, hook_host, steps as bench_steps
from experiments.bench.common import (VARIANTS, NoOpOptimizer, human, make_params, make_scaler, paired_ratio,
                                     parse_size, quiet, restore, scaling_step)
from strategies import kernels
from strategies.stats import unscale_and_stats, unscale_and_stats_reference

__all__ = ["DEFAULT_SIZES", "step_timer", "bench_overhead", "bench_stats_pass", "format_tables",
    "machine_info", "build_parser", "GPU_ONLY", "CPU_DOCS", "cpu_page", "main"]

DEFAULT_SIZES = "1M,10M,50M"
def step_timer(scaler: Any, opt: torch.optim.Optimizer, loss: torch.Tensor) -> Callable[[], float]:
    """One timed training-step's worth of scaling calls (:func:`bench_common.scaling_step`);
    returns seconds."""
    step = scaling_step(scaler, opt, loss)

    def run() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    return run


def bench_overhead(numel: int, tensors: int, names: list[str], repeats: int, steps: int) -> list[dict[str, Any]]:
    params, master = make_params(numel, tensors)
    opt = NoOpOptimizer(params)
    loss = torch.tensor(1.0)
    runners = {n: step_timer(make_scaler(n), opt, loss) for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up: lazy init, first allocations, kernel build/load
        restore(params, master)
        runners[n]()
    order = random.Random(0)
    for _ in range(repeats):  # rounds in a shuffled order: drift and position hit every strategy alike
        for n in order.sample(names, len(names)):
            per_step = []
            for _ in range(steps):
                restore(params, master)
                per_step.append(runners[n]())
            samples[n].append(statistics.median(per_step))
    rows = []
    for n in names:
        med = statistics.median(samples[n])
        # The ratio is the median of per-round ratios (same round, side by side), not a ratio of
        # medians: a slow round then slows both sides of its own ratio.
        ratio = paired_ratio(samples[n], samples["GradScaler"]) if "GradScaler" in samples else None
        rows.append({
            "size": numel, "tensors": tensors, "name": n, "median_ms": med * 1e3,
            "ratio_vs_gradscaler": ratio,
            "samples_ms": [s * 1e3 for s in samples[n]],
        })
    return rows


def bench_stats_pass(numel: int, tensors: int, repeats: int) -> dict[str, Any]:
    params, master = make_params(numel, tensors, seed=1)
    grads = [p.grad for p in params]
    inv = torch.tensor(2.0**-16)
    calls: dict[str, Callable[[], Any]] = {
        "fused": lambda: unscale_and_stats(grads, inv),
        "foreach_mul": lambda: torch._foreach_mul_(grads, inv),
        "torch_unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        "reference": lambda: unscale_and_stats_reference(grads, inv),
    }
    found = torch.zeros(())
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():  # warm-up
        restore(params, master)
        fn()
    order = random.Random(1)
    # fused, _foreach_mul_ and GradScaler's unscale in shuffled rounds, as (a); the reference (40x
    # slower, and its temporaries slow whatever runs next) in rounds of its own after them.
    for pair in (["fused", "foreach_mul", "torch_unscale"], ["reference"]):
        for _ in range(repeats):
            for k in order.sample(pair, len(pair)):
                restore(params, master)
                t0 = time.perf_counter()
                calls[k]()
                samples[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    return {
        "size": numel, "tensors": tensors,
        "fused_ms": med["fused"], "foreach_mul_ms": med["foreach_mul"], "torch_unscale_ms": med["torch_unscale"],
        "reference_ms": med["reference"],
        "fused_over_foreach_mul": paired_ratio(samples["fused"], samples["foreach_mul"]),
        "fused_over_torch_unscale": paired_ratio(samples["fused"], samples["torch_unscale"]),
        "reference_over_fused": med["reference"] / med["fused"],
        "fused_is_kernel": kernels.available(),
        "samples_ms": {k: [s * 1e3 for s in v] for k, v in samples.items()},
    }


def format_tables(overhead: list[dict[str, Any]], stats_rows: list[dict[str, Any]], names: list[str]) -> str:
    lines = ["(a) per-step scaling overhead: scale + unscale_ + step + update (no-op optimizer),",
             "    median ms; in brackets: median over rounds of the ratio to torch.amp.GradScaler in the same round", ""]
    header = f"{'params':>8} " + " ".join(f"{n:>18}" for n in names)
    lines += [header, "-" * len(header)]
    for size in sorted({r["size"] for r in overhead}):
        cells = []
        for n in names:
            r = next(x for x in overhead if x["size"] == size and x["name"] == n)
            ratio = "" if r["ratio_vs_gradscaler"] is None else f" [{r['ratio_vs_gradscaler']:.2f}x]"
            cells.append(f"{r['median_ms']:9.3f}{ratio:>9}")
        lines.append(f"{human(size):>8} " + " ".join(f"{c:>18}" for c in cells))
    lines += ["", "(b) statistics pass vs one in-place _foreach_mul_, GradScaler's unscale (no statistics) and the",
              "    plain-torch reference, median ms; fused/mul, fused/unscale: median over rounds of the same",
              "    round's ratio", ""]
    header = (f"{'params':>8} {'fused':>10} {'foreach_mul':>12} {'unscale':>10} {'reference':>11} "
              f"{'fused/mul':>10} {'fused/unscale':>14} {'ref/fused':>10}")
    lines += [header, "-" * len(header)]
    for r in stats_rows:
        lines.append(f"{human(r['size']):>8} {r['fused_ms']:10.3f} {r['foreach_mul_ms']:12.3f} "
                     f"{r['torch_unscale_ms']:10.3f} {r['reference_ms']:11.3f} {r['fused_over_foreach_mul']:9.2f}x "
                     f"{r['fused_over_torch_unscale']:13.2f}x {r['reference_over_fused']:9.2f}x")
    if stats_rows and not stats_rows[0]["fused_is_kernel"]:
        lines.append("note: the fused op is not built here; 'fused' ran the plain-torch fallback")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "kernels_available": kernels.available(),
    }
    try:
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scalelab-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default: sections a-d) or cuda (experiments.bench.gpu: statistics-pass GB/s and "
                        "full steps vs GradScaler, CUDA events, writes a Markdown page)")
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated parameter counts (default {DEFAULT_SIZES}; cuda: the statistics pass, "
                        f"default {bench_gpu.DEFAULT_STATS_SIZES})")
    p.add_argument("--tensors", type=int, default=50, help="gradient tensors the parameters are split into (50)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"repeats per configuration; medians reported (7, and at least {bench_steps.HOOK_ROUNDS} in (c) "
                        f"and {bench_steps.EVERY_ROUNDS} in (e) unless given; cuda: {bench_gpu.DEFAULT_REPEATS})")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat in (a), median taken (3; cpu only)")
    p.add_argument("--strategies", default=None, help="comma-separated strategy names (default: all registered)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="sizes 1M and 3 repeats unless given: a smoke run")
    p.add_argument("--out", default="bench.json", help="JSON output path (bench.json)")
    gpu = p.add_argument_group("--device cuda only")
    gpu.add_argument("--step-sizes", default=None,
                     help=f"parameter counts of the full-step comparison (default {bench_gpu.DEFAULT_STEP_SIZES})")
    gpu.add_argument("--dtypes", default=None, help=f"statistics-pass gradient dtypes (default {bench_gpu.DEFAULT_DTYPES})")
    gpu.add_argument("--warmup", type=int, default=None, help=f"warm-up rounds ({bench_gpu.DEFAULT_WARMUP})")
    p.add_argument("--write-docs", default=None, metavar="PATH",
                   help=f"the generated Markdown page (cpu: only when given, `make bench` writes {CPU_DOCS}; "
                        f"cuda: default {bench_gpu.DEFAULT_DOCS})")
    gpu.add_argument("--no-docs", action="store_true", help="write no Markdown page")
    return p


GPU_ONLY = ("step_sizes", "dtypes", "warmup", "no_docs")
CPU_DOCS = "docs/bench-cpu.md"


def cpu_page(text: str, meta: dict[str, Any]) -> str:
    """The CPU benchmark's Markdown page: what made it, the machine, and the printed tables."""
    command = "scalelab-bench " + " ".join(meta.get("argv") or [])
    machine = ", ".join(f"{k} {meta[k]}" for k in ("cpu_count", "torch_threads", "cpu_capability", "torch")
                        if meta.get(k) is not None)
    return (f"# scalelab-bench on the CPU\n\n<!-- Generated by `{command.strip()}`; do not edit by hand: "
            f"run the command again. -->\n\nGenerated {meta.get('date_utc', '')} by `{command.strip()}` ({machine}; "
            f"load average before {meta.get('loadavg_before')}). What each section measures: the docstrings of "
            "`experiments/bench/cli.py` and `experiments/bench/steps.py`; how to read it: `docs/kernels.md`.\n\n"
            f"```text\n{text.rstrip()}\n```\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    for field in ("tensors", "steps"):
        if getattr(args, field) is not None and getattr(args, field) < 1:
            parser.error(f"--{field} must be >= 1, got {getattr(args, field)}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    registered = strategies.available()
    chosen = registered if args.strategies is None else [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in registered]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; available: {registered}")
    names = ["none", "GradScaler", *chosen, *(v for v, (base, _) in VARIANTS.items() if base in chosen)]
    if args.device == "cuda":
        return _main_cuda(parser, args, names, argv_used)
    given = [f"--{f.replace('_', '-')}" for f in GPU_ONLY if getattr(args, f) not in (None, False)]
    if given:
        parser.error(f"{', '.join(given)}: only with --device cuda")
    sizes_text = args.sizes or ("1M" if args.quick else DEFAULT_SIZES)
    try:
        sizes = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    steps = args.steps if args.steps is not None else 3

    kernels.load()  # build/load before timing anything
    load_before = machine_info().get("loadavg_1_5_15")

    def at_least(rounds: int) -> int:
        """Sections (c) and (e) run at least ``rounds`` rounds unless ``--quick`` or ``--repeats`` says otherwise."""
        return repeats if args.quick or args.repeats is not None else max(repeats, rounds)

    overhead: list[dict[str, Any]] = []
    stats_rows: list[dict[str, Any]] = []
    with quiet():
        for size in sizes:
            tensors = min(args.tensors, size)
            print(f"measuring {human(size)} parameters in {tensors} tensors ...", file=sys.stderr, flush=True)
            overhead += bench_overhead(size, tensors, names, repeats, steps)
            stats_rows.append(bench_stats_pass(size, tensors, repeats))
        print("measuring hooks and fused AdamW ...", file=sys.stderr, flush=True)
        pooled = not (args.quick or args.repeats is not None)
        hook_rows = bench_steps.bench_hooks(at_least(bench_steps.HOOK_ROUNDS),
                                            processes=bench_steps.HOOK_PROCESSES if pooled else 1)
        host_rows = hook_host.bench_hook_host(at_least(hook_host.HOST_ROUNDS))
        op_rows = boundary_ops.bench_boundary_ops(at_least(boundary_ops.OPS_ROUNDS))
        fused_size = sizes[-1]
        fused_rows = bench_steps.bench_fused(*make_params(fused_size, min(args.tensors, fused_size)), names, repeats)
        every_rows = bench_steps.bench_every(at_least(bench_steps.EVERY_ROUNDS), held=pooled)
    meta = {**machine_info(), "loadavg_before": load_before, "repeats": repeats, "steps": steps,
            "argv": argv_used}
    result = {"meta": meta, "overhead": overhead, "stats_pass": stats_rows, "hooks": hook_rows, "hook_host": host_rows,
              "boundary_ops": op_rows, "fused_adamw": fused_rows,
              "stats_every": every_rows}
    text = (format_tables(overhead, stats_rows, names) + "\n\n" + bench_steps.format_hooks(hook_rows) + "\n\n"
            + hook_host.format_hook_host(host_rows) + "\n\n" + boundary_ops.format_boundary_ops(op_rows) + "\n\n"
            + bench_steps.format_fused(fused_rows, human(fused_size)) + "\n\n" + bench_steps.format_every(every_rows))
    la = meta.get("loadavg_1_5_15")
    if la:
        text += (f"\n\nload average (1/5/15 min) before: {load_before}, after: {[round(x, 2) for x in la]}; "
                 f"{meta['cpu_count']} CPUs, torch threads {meta['torch_threads']}, CPU capability {meta['cpu_capability']}")
    print(text)
    _write_json(result, args.out)
    if args.write_docs:
        write_text_atomic(args.write_docs, cpu_page(text, meta))
        print(f"wrote {args.write_docs}", file=sys.stderr)
    return 0


def _main_cuda(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str],
               argv_used: list[str]) -> int:
    """``--device cuda``: :mod:`experiments.bench.gpu`, its tables printed, JSON and the page written."""
    if not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__}, "
                     f"built with CUDA {torch.version.cuda})")
    if args.steps is not None:
        parser.error("--steps: only with --device cpu (a GPU round times one step per configuration)")
    try:
        opts = bench_gpu.gpu_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    kernels.load()  # build/load before timing anything
    with quiet():
        result = bench_gpu.run(opts, args.tensors, names, lambda s: print(s, file=sys.stderr, flush=True))
    result["meta"] = {**machine_info(), **bench_gpu.gpu_info(), "repeats": opts.repeats, "warmup": opts.warmup,
                      "argv": argv_used}
    print(bench_gpu.format_markdown(result))
    _write_json(result, args.out)
    if opts.docs is not None:
        bench_gpu.write_page(result, opts.docs)
        print(f"wrote {opts.docs}", file=sys.stderr)
    return 0


def _write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
