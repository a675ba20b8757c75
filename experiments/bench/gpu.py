"""``scalelab-bench --device cuda``: the GPU section, timed with CUDA events.

(i) **Statistics pass bandwidth** — :func:`strategies.stats.unscale_and_stats` (the fused CUDA
kernel) against one in-place ``torch._foreach_mul_`` by a host scalar (the floor of any in-place
pass: every gradient read once and written once, in torch's multi-tensor kernel for every dtype; a
float32 tensor scalar would send float16/bfloat16 lists to one kernel per tensor), GradScaler's own unscale
``torch._amp_foreach_non_finite_check_and_unscale_`` (no statistics; torch has no bfloat16 CUDA
kernel for it, pytorch issue 127176, so that cell reads n/a) and the plain-torch multi-pass
reference :func:`strategies.stats.unscale_and_stats_reference`, for float16, bfloat16 and float32
gradients at each size. Bandwidth = 2 x parameters x bytes per element / time: every call is
charged one read and one write of the gradients (the reference's extra passes show as a lower
effective bandwidth).

(ii) **Full step** — ``scale`` + ``unscale_`` + ``step`` + ``update`` with a no-op optimizer on
float32 gradients, for every registered rule (and :data:`experiments.bench.common.VARIANTS`),
``torch.amp.GradScaler("cuda")`` and no scaling: median ms and the ratio to GradScaler. GradScaler
and the rules sync once in ``step`` (the skip decision); the events see that as time too.

(ii b) **Full step with a fused optimizer** — ``scale`` + ``step`` + ``update`` with an optimizer
that takes ``grad_scale``/``found_inf`` as fused Adam/AdamW/SGD do: no host sync, so the device work
alone.

(iii) **Per-layer rules on the GPT step** — section (c) of the CPU bench on the GPU
(:mod:`experiments.bench.gpu_hooks`): the attached rules against the plain step, synchronised host clock,
and the peak memory of one step each (the caching allocator's, :func:`experiments.bench.common.peak_bytes`).

Method ((i) and (ii)): each round runs every configuration once, in a shuffled order; before each timed
call the gradients are restored from a master copy and the L2 cache is flushed (a 256 MiB
write), outside the timed region; a pair of CUDA events brackets the call alone, behind a short
GPU sleep so that they time the device, not the host's launches (:func:`time_rounds`). ``warmup``
rounds run first (kernel load, allocator, lazy state). Times are medians over the rounds; a
ratio is the median over rounds of the same round's ratio, so both sides share the round.

The run writes a generated Markdown page (:func:`format_markdown`; ``docs/bench.md`` by default):
machine, torch, date, command and the tables, never hand-typed numbers.
"""

from __future__ import annotations

import argparse
import platform
import random
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from experiments.app.records import write_text_atomic
from experiments.bench.common import (NoOpFusedOptimizer, NoOpOptimizer, human, make_params, make_scaler,
                                     paired_ratio, parse_size, restore, scaling_step)
from experiments.bench.gpu_hooks import bench_hooks_gpu, format_hooks_table
from strategies.stats import unscale_and_stats, unscale_and_stats_reference

__all__ = ["REGENERATE", "DTYPES", "DEFAULT_STATS_SIZES", "DEFAULT_STEP_SIZES", "DEFAULT_DTYPES", "QUICK", "DEFAULT_DOCS",
    "L2_FLUSH_BYTES", "LEAD_CYCLES", "STATS_CALLS", "STATS_LABELS", "GpuOptions", "parse_dtypes",
    "gpu_options", "gbps", "time_rounds", "l2_flush", "torch_unscale_supports", "bench_stats_pass",
    "bench_steps", "gpu_info", "run", "format_stats_table", "format_steps_table", "format_markdown",
    "write_page"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_STATS_SIZES = "10M,30M,100M"
DEFAULT_STEP_SIZES = "10M,100M"
DEFAULT_DTYPES = "fp16,bf16,fp32"
DEFAULT_REPEATS, DEFAULT_WARMUP = 50, 5
QUICK = {"sizes": "1M", "step_sizes": "1M", "repeats": 5, "warmup": 2}
DEFAULT_DOCS = Path("docs") / "bench.md"
L2_FLUSH_BYTES = 256 * 2**20
"""Larger than any GPU's L2 (H100: 50 MB, H200: 60 MB, B200: 126 MB)."""
LEAD_CYCLES = 2_000_000
"""GPU clock cycles of the sleep queued ahead of each timed call (about 1 ms at 2 GHz): longer
than the host needs to enqueue the fused pass or a step's kernels before its sync."""

STATS_CALLS = ("fused", "foreach_mul", "torch_unscale", "reference")
STATS_LABELS = {"fused": "fused pass", "foreach_mul": "`_foreach_mul_`", "torch_unscale": "GradScaler unscale",
                "reference": "plain-torch reference"}


@dataclass
class GpuOptions:
    """The GPU run's settings, resolved from the command line (:func:`gpu_options`)."""

    stats_sizes: list[int]
    step_sizes: list[int]
    dtypes: list[str]
    repeats: int
    warmup: int
    docs: Path | None


def parse_dtypes(text: str) -> list[str]:
    """``"fp16,bf16"`` -> ``["fp16", "bf16"]``; each must be one of :data:`DTYPES`."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise ValueError(f"--dtypes must be a comma-separated subset of {', '.join(DTYPES)}, got {text!r}")
    return names


def gpu_options(args: argparse.Namespace) -> GpuOptions:
    """Resolve the GPU settings; ``ValueError`` (one line naming the flag) for bad values."""
    quick = args.quick
    repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if quick else DEFAULT_REPEATS)
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if quick else DEFAULT_WARMUP)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    return GpuOptions(
        stats_sizes=_sizes(args.sizes or (QUICK["sizes"] if quick else DEFAULT_STATS_SIZES), "--sizes"),
        step_sizes=_sizes(args.step_sizes or (QUICK["step_sizes"] if quick else DEFAULT_STEP_SIZES), "--step-sizes"),
        dtypes=parse_dtypes(args.dtypes or DEFAULT_DTYPES),
        repeats=repeats, warmup=warmup,
        docs=None if args.no_docs else Path(args.write_docs) if args.write_docs else DEFAULT_DOCS,
    )


def _sizes(text: str, flag: str) -> list[int]:
    try:
        out = [parse_size(s) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not out:
        raise ValueError(f"{flag} must name at least one size, got {text!r}")
    return out


def gbps(numel: int, dtype: str, ms: float) -> float:
    """GB/s of a pass that reads and writes ``numel`` elements of ``dtype`` once in ``ms``:
    ``2 * numel * element size / seconds / 1e9``."""
    return 2 * numel * DTYPES[dtype].itemsize / (ms * 1e-3) / 1e9


def time_rounds(calls: dict[str, Callable[[], Any]], setup: Callable[[], None], repeats: int,
                warmup: int, seed: int = 0) -> dict[str, list[float]]:
    """Milliseconds of each call in each round, from CUDA events around the call alone; every
    round runs each call once in a shuffled order, ``setup()`` before each (outside the events).

    A ``torch.cuda._sleep`` of :data:`LEAD_CYCLES` is queued before the start event, so the host
    has enqueued the call's kernels before the GPU reaches it: the events then time the device
    work, not the host's launch overhead (as in a training loop, where the host runs ahead of the
    GPU until a sync). Time after a host sync inside the call (GradScaler's skip decision) is
    counted: the GPU waits for the host there. One synchronisation at the end."""
    for _ in range(warmup):
        for fn in calls.values():
            setup()
            fn()
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in calls}
    order = random.Random(seed)
    for _ in range(repeats):
        for k in order.sample(list(calls), len(calls)):
            setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(LEAD_CYCLES)
            start.record()
            calls[k]()
            end.record()
            events[k].append((start, end))
    torch.cuda.synchronize()
    return {k: [s.elapsed_time(e) for s, e in pairs] for k, pairs in events.items()}


def l2_flush(device: str = "cuda") -> Callable[[], None]:
    """A call that overwrites :data:`L2_FLUSH_BYTES` on the device, so no timed call finds the
    gradients in the L2 cache."""
    buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return lambda: buf.zero_()


def torch_unscale_supports(dtype: torch.dtype, device: str = "cuda") -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` takes ``dtype`` on ``device``."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(1, dtype=dtype, device=device)], torch.zeros(1, device=device), torch.ones(1, device=device))
    except RuntimeError:
        return False
    return True


def bench_stats_pass(master: list[torch.Tensor], dtype: str, repeats: int, warmup: int,
                     flush: Callable[[], None]) -> dict[str, Any]:
    """Section (i) at one size and dtype: the gradients are ``master`` cast to ``dtype``."""
    grads = [m.to(DTYPES[dtype], copy=True) for m in master]  # a copy also for fp32: master stays as drawn
    saved = [g.clone() for g in grads]
    inv = torch.tensor(2.0**-16, device=grads[0].device)
    found = torch.zeros((), device=grads[0].device)
    calls: dict[str, Callable[[], Any]] = {
        "fused": lambda: unscale_and_stats(grads, inv),
        "foreach_mul": lambda: torch._foreach_mul_(grads, 2.0**-16),  # a host scalar: the one-kernel path
        "reference": lambda: unscale_and_stats_reference(grads, inv),
    }
    if torch_unscale_supports(DTYPES[dtype]):
        calls["torch_unscale"] = lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def setup() -> None:
        torch._foreach_copy_(grads, saved)
        flush()

    ms = time_rounds(calls, setup, repeats, warmup, seed=1)
    numel = sum(g.numel() for g in grads)
    row: dict[str, Any] = {"size": numel, "tensors": len(grads), "dtype": dtype,
                           "fused_is_kernel": torch._C._dispatch_has_kernel_for_dispatch_key(
                               "scalelab::unscale_and_stats", "CUDA")}
    for k in STATS_CALLS:
        med = statistics.median(ms[k]) if k in ms else None
        row[f"{k}_ms"] = med
        row[f"{k}_gbps"] = None if med is None else gbps(numel, dtype, med)
    for other in ("foreach_mul", "torch_unscale"):
        row[f"fused_over_{other}"] = paired_ratio(ms["fused"], ms[other]) if other in ms else None
    row["reference_over_fused"] = paired_ratio(ms["reference"], ms["fused"])
    row["samples_ms"] = ms
    return row


def bench_steps(numel: int, tensors: int, names: list[str], repeats: int, warmup: int,
                flush: Callable[[], None], fused: bool = False) -> list[dict[str, Any]]:
    """Section (ii) at one size: rows shaped as the CPU bench's ``overhead`` rows (what
    ``scalelab-report --bench`` reads), plus ``device`` and ``fused``. ``fused``: the optimizer
    takes ``grad_scale``/``found_inf`` (:class:`experiments.bench.common.NoOpFusedOptimizer`), so
    no call syncs and the events time the device work alone (section (ii b))."""
    params, master = make_params(numel, tensors, device="cuda")
    opt = NoOpFusedOptimizer(params) if fused else NoOpOptimizer(params)
    loss = torch.tensor(1.0, device="cuda")
    calls = {n: scaling_step(make_scaler(n, "cuda"), opt, loss, unscale=not fused) for n in names}

    def setup() -> None:
        restore(params, master)
        flush()

    ms = time_rounds(calls, setup, repeats, warmup, seed=0)
    return [{"size": numel, "tensors": tensors, "name": n, "device": "cuda", "fused": fused,
             "median_ms": statistics.median(ms[n]),
             "ratio_vs_gradscaler": paired_ratio(ms[n], ms["GradScaler"]) if "GradScaler" in ms else None,
             "samples_ms": ms[n]} for n in names]


def gpu_info() -> dict[str, Any]:
    """The GPU the run measured and the CUDA torch was built with."""
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": "cuda", "gpu": p.name, "compute_capability": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "torch_cuda": torch.version.cuda, "python": platform.python_version()}


def run(opts: GpuOptions, tensors: int, names: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """The sections; returns ``{"stats_pass": rows, "overhead": rows, "fused_steps": rows, "hooks": rows}``."""
    flush = l2_flush()
    stats_rows: list[dict[str, Any]] = []
    for size in opts.stats_sizes:
        log(f"statistics pass at {human(size)} parameters ({', '.join(opts.dtypes)}) ...")
        _, master = make_params(size, min(tensors, size), seed=1, device="cuda")
        stats_rows += [bench_stats_pass(master, d, opts.repeats, opts.warmup, flush) for d in opts.dtypes]
        del master
    step_rows: list[dict[str, Any]] = []
    fused_rows: list[dict[str, Any]] = []
    for size in opts.step_sizes:
        log(f"full steps at {human(size)} parameters, then with a fused optimizer ...")
        step_rows += bench_steps(size, min(tensors, size), names, opts.repeats, opts.warmup, flush)
        fused_rows += bench_steps(size, min(tensors, size), names, opts.repeats, opts.warmup, flush, fused=True)
    log("per-layer rules on the GPT step ...")
    return {"stats_pass": stats_rows, "overhead": step_rows, "fused_steps": fused_rows,
            "hooks": bench_hooks_gpu(opts.repeats)}


def _cell(gbps_value: float | None, ms: float | None) -> str:
    return "n/a" if gbps_value is None or ms is None else f"{gbps_value:,.0f} ({ms:.3f} ms)"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def format_stats_table(rows: list[dict[str, Any]]) -> str:
    head = ["dtype", "params", *(f"{STATS_LABELS[k]} GB/s (ms)" for k in STATS_CALLS),
            "fused / mul", "fused / unscale", "reference / fused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dtype"], human(r["size"]), *(_cell(r[f"{k}_gbps"], r[f"{k}_ms"]) for k in STATS_CALLS),
                 _ratio(r["fused_over_foreach_mul"]), _ratio(r["fused_over_torch_unscale"]),
                 _ratio(r["reference_over_fused"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_steps_table(rows: list[dict[str, Any]]) -> str:
    sizes = sorted({r["size"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    head = ["rule", *(f"{human(s)}: ms / vs GradScaler" for s in sizes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        cells = [n]
        for s in sizes:
            r = next(x for x in rows if x["name"] == n and x["size"] == s)
            cells.append(f"{r['median_ms']:.3f} / {_ratio(r['ratio_vs_gradscaler'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    """The generated page: what ran where (from ``result["meta"]``), then both tables."""
    m = result["meta"]
    command = "scalelab-bench " + shlex.join(m["argv"])
    kernel = all(r["fused_is_kernel"] for r in result["stats_pass"])
    lines = [
        "# scalelab-bench on a GPU",
        "",
        f"<!-- Generated by `{command}`; do not edit by hand: run the command again. -->",
        "",
        f"Generated {m['date_utc']} by `{command}`.",
        "",
        "| | |", "|---|---|",
        f"| GPU | {m['gpu']} (compute capability {m['compute_capability']}, {m['sm_count']} SMs, "
        f"{m['gpu_memory_gib']} GiB) |",
        f"| torch | {m['torch']} (CUDA {m['torch_cuda']}), Python {m['python']}, {m['machine']} host |",
        f"| fused kernel | {'the CUDA op' if kernel else 'NOT built: the fused column ran the plain-torch fallback'} |",
        f"| timing | CUDA events around each call, queued behind a ~1 ms GPU sleep (the host has launched the "
        f"call's kernels before the GPU reaches them); median of {m['repeats']} rounds after {m['warmup']} "
        "warm-up rounds, configurations in a shuffled order each round; gradients restored and a 256 MiB L2 "
        "flush before every call, outside the events |",
        "",
        "## (i) Statistics pass: bandwidth",
        "",
        "GB/s = 2 x parameters x bytes per element / median time (one read and one write of every gradient; "
        "the reference's extra passes, and its host time to launch its many small kernels, show as a lower "
        "effective bandwidth). `_foreach_mul_` multiplies by a host scalar. The gradients are split into "
        f"{result['stats_pass'][0]['tensors'] if result['stats_pass'] else '-'} tensors and unscaled by 2^-16. "
        "Ratios are time ratios, the median over rounds of the same round's ratio: below 1 the fused pass "
        "is faster. GradScaler's unscale has no bfloat16 CUDA kernel in torch (n/a).",
        "",
        format_stats_table(result["stats_pass"]),
        "",
        "## (ii) Full step vs torch.amp.GradScaler(\"cuda\")",
        "",
        "scale + unscale_ + step + update with a no-op optimizer on float32 gradients: median ms and, "
        "after the slash, the median over rounds of the ratio to GradScaler in the same round. `none` is "
        "no scaling (the loss as is and the optimizer step). The step's host sync (the skip decision) is "
        "inside the timed region. A rule at scale 1 only reads the gradients (the pass skips the write): "
        "`layerwise_adaloss` starts there (AdaLoss's initial scale), the others at 2^10 to 2^16.",
        "",
        format_steps_table(result["overhead"]),
        "",
        *(["## (ii b) Full step with a fused optimizer: no host sync", "",
           "scale + step + update (`unscale_` left to `step`) with an optimizer that takes its scaling as fused "
           "Adam/AdamW/SGD do (`_step_supports_amp_scaling`, here a no-op): GradScaler and the rules hand it "
           "`grad_scale` and `found_inf` on the device and nothing reads the host, so the events time the device "
           "work alone "
           "(the host's launches run ahead behind the GPU sleep, as in training with a fused optimizer). "
           "GradScaler and the global rules leave the unscaling to the optimizer: GradScaler checks the gradients "
           "for Inf/NaN with its unscale kernel at scale 1, the global rules read them once (the statistics pass "
           "without its write); the per-layer rules still unscale (their scales differ by group).",
           "", format_steps_table(result["fused_steps"]), ""] if result.get("fused_steps") else []),
        *(["## (iii) Per-layer rules attached vs not on the GPT step", "", "The character GPT (4 blocks of width "
           "128, batch 16 x 64, float32): a training step with the rule attached against the same step without, "
           "host clock with a device synchronize at both ends of each step, median ms of "
           f"{m['repeats']} rounds; the ratio is the median over rounds of attached / plain in the same round, with "
           "its 95 % interval; peak MiB: the most one plain step held allocated at once beyond what was allocated "
           "before it, and +MiB what the attached step held beyond that (the rescaled copies at the boundaries).",
           "", format_hooks_table(result["hooks"]), ""] if result.get("hooks") else []),
        *REGENERATE,
    ]
    return "\n".join(lines)


REGENERATE = [
    "## How to regenerate",
    "",
    "On a CUDA machine with a CUDA build of torch in `.venv` (`make setup TORCH_SPEC=torch`), one command "
    "runs the GPU pass in at most 8 minutes: `make gpu-pass` (each part under its own `timeout`: the "
    "extension built for `GPU_ARCH` (9.0, an H100 or H200, by default) and every `gpu`-marked test "
    "(`pytest -m gpu tests/cuda tests/experiments/test_bench_gpu.py`: the statistics, update and "
    "layer-boundary kernels against their CPU twins and references, none syncing with the host) in 6 "
    "minutes, then `scalelab-bench --device cuda --write-docs docs/bench.md` in 2, which rewrites this page).",
    "",
]
"""The page's last section: the one command of the GPU pass (``make gpu-pass``)."""


def write_page(result: dict[str, Any], path: Path) -> None:
    write_text_atomic(path, format_markdown(result))
