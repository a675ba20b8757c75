"""``scalelab-bench`` sections (c) and (d): what a training step costs around the scaler.

(c) **Attach cost per step** — forward + scaled backward + unscale_/step/update of a fixed MLP
(8 x 512-wide layers, batch 256) and of the character GPT (:data:`HOOK_MODELS`), with the
strategy attached (its layer-boundary transforms run, and it gathers what it needs per step:
AdaLoss's weight statistics) and without; the difference is the hooks' cost per backward plus
those statistics. Only the strategies whose ``attach`` installs hooks.

(e) **Statistics every k steps, of a share of the layers** — the attached rules with
``stats_every = k`` (1, 4, 16) and ``stats_layers = q`` (0.5, 0.25) against the plain step
(:func:`bench_every`).

(d) **Fused AdamW** — ``AdamW(fused=True)`` stepping the benchmark's gradients: with
``unscale_()`` first (the strategy's own in-place pass, then the optimizer) and without it (the
optimizer unscales in its kernel; the strategy only reads the gradients for its statistics, as
``torch.amp.GradScaler`` hands ``grad_scale`` over). The difference is the pass saved.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

try:
    import resource
except ImportError:  # not on Windows: no fault counts there
    resource = None

import torch
import torch.nn.functional as F

import strategies
from experiments.workloads.models import GPT
from experiments.bench.common import (HOOKED, NoOpOptimizer, make_scaler, paired_ms, paired_ratio, peak_bytes, quiet,
                                     ratio_fields, train_step)

__all__ = ["EVERY", "EVERY_ROUNDS", "HOOK_MODELS", "HOOK_PROCESSES", "HOOK_ROUNDS", "bench_every", "bench_hooks", "bench_fused",
           "format_every", "format_fused", "format_hooks", "hook_times", "interval_text", "table"]


def _mlp(device: str = "cpu") -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """The 8 x 512 MLP (batch 256, MSE): its 9 linear layers are its groups/boundaries."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())],
                                torch.nn.Linear(512, 1))
    x, y = torch.randn(256, 512).to(device), torch.randn(256, 1).to(device)
    return model.to(device), lambda m: F.mse_loss(m(x), y)


def _gpt(device: str = "cpu") -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """The character GPT of ``experiments.workloads.models`` (4 blocks of width 128, batch 16 x 64
    tokens, next-token cross-entropy): boundaries ``embed``, ``blocks.0..3``, ``ln_f``, ``head``."""
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    idx = torch.randint(0, 256, (16, 65)).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    return model.to(device), lambda m: F.cross_entropy(m(x).flatten(0, 1), y.flatten())


HOOK_MODELS = {"mlp": _mlp, "gpt": _gpt}
"""Section (c)'s models: name -> (model, its loss)."""
HOOK_ROUNDS = 64
"""Section (c)'s rounds at least (``scalelab-bench`` without ``--quick`` or ``--repeats``): its target is a ratio
within 5 % of 1, and 7 rounds moved one rule's median ratio by 0.02 between runs on a quiet CPU
(1.061 against 1.042 and 1.043 at 61 rounds); spread over :data:`HOOK_PROCESSES` processes, 8 rounds
each, they take ~70 s."""
HOOK_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
"""The glibc settings section (c)'s pooled processes (and (e)'s one) run under for their ratios: with
glibc's defaults, ``free`` hands the top of the heap back to the kernel once more than a
(self-adjusting) threshold is free there, and the next step faults those pages in again. Whether a
step's pattern of frees trips it depends on the process's heap layout: on 2026-11-27 the attached
``underflow_target`` MLP step took a median of 688 minor page faults a step and the plain one none,
and its per-process ratio ranged 1.035-1.132 over eight processes; with the heap held (mmap only
above 32 MiB, trimming above 1 GiB) eight read 1.022-1.036 (docs/bench-cpu.md). The rows keep what
the defaults gave beside it (``ratio_default``, and the faults per step)."""
HOOK_PROCESSES = 8
"""Section (c)'s fresh interpreters (``scalelab-bench`` without ``--quick`` or ``--repeats``): a rule's
median ratio moves from one process to the next by more than the 95 % interval of one process's
rounds (``layerwise_adaloss`` on the MLP: 1.049-1.071 over six processes of 31 rounds, 1.051-1.058
over six fresh copies in one process; ``underflow_target``: 1.043-1.132 over eight processes, under
glibc's defaults), so its rounds are spread over this many processes and pooled. Four pooled runs of
8 x 8 rounds agreed within 0.011 on every row; two of 3 x 21 rounds differed by 0.036 on
``underflow_target``. Much of that spread was the heap (:data:`HOOK_MALLOC`); with it held, three
pooled runs read ``layerwise_adaloss`` at 1.051, 1.051 and 1.050."""


def bench_hooks(repeats: int, models: tuple[str, ...] = ("mlp", "gpt"), device: str = "cpu",
                clock: Callable[[], float] = time.thread_time, processes: int = 1) -> list[dict[str, Any]]:
    """Per model, two copies, one with the strategy attached, timed round by round: a training
    step's forward, scaled backward and unscale_/step (no-op optimizer)/update, so the attached
    side pays its hooks and what it gathers per step (AdaLoss: the weight statistics). ``device``
    and ``clock``: the GPU section passes ``"cuda"`` and a clock that synchronises first.
    ``processes > 1`` (CPU, thread-time clock): the rounds are split over that many fresh
    interpreters, one after the other, and pooled (:data:`HOOK_PROCESSES`); each row then also has ``process_ratios``, each
    process's own median ratio."""
    if processes > 1:
        return _pooled(repeats, models, processes)
    return [_hook_row(rec) for rec in hook_times(repeats, models, device, clock)]


def hook_times(repeats: int, models: tuple[str, ...], device: str = "cpu",
               clock: Callable[[], float] = time.thread_time, threads: int | None = None) -> list[dict[str, Any]]:
    """:func:`bench_hooks`'s measurements before they are summed up: per model and rule, the
    milliseconds of every round (``plain``, ``hooked``) and, on a GPU, the peak memory."""
    if threads is not None:  # a fresh interpreter (a pooled process) takes its parent's setting
        torch.set_num_threads(threads)
    out = []
    for model_name in models:
        model, loss_of = HOOK_MODELS[model_name](device)
        for label, kw in HOOKED.items():
            name = "layerwise" if label.startswith("layerwise") else label
            attached_model = copy.deepcopy(model)
            with quiet():
                plain = strategies.create(name, **kw)
                hooked = strategies.create(name, **kw).attach(attached_model)
                opt, attached_opt = NoOpOptimizer(list(model.parameters())), NoOpOptimizer(list(attached_model.parameters()))
                steps = {"plain": lambda: train_step(model, plain, opt, loss_of),
                         "hooked": lambda: train_step(attached_model, hooked, attached_opt, loss_of)}
                faults = {"plain": [], "hooked": []}
                t = paired_ms({k: _counted(fn, faults[k]) for k, fn in steps.items()}, repeats, clock=clock)
                memory = {}
                if device == "cuda":  # the CPU keeps no allocator peak to read (peak_bytes)
                    mib = {k: peak_bytes(fn, device) / 2**20 for k, fn in steps.items()}
                    memory = {"plain_peak_mib": mib["plain"], "attached_peak_mib": mib["hooked"],
                              "extra_peak_mib": mib["hooked"] - mib["plain"]}
            hooked.detach()
            out.append({"model": model_name, "strategy": label, "plain": t["plain"], "hooked": t["hooked"],
                        "faults": {k: f[1:] for k, f in faults.items()}, "memory": memory})  # [0]: the warm-up
    return out


def minor_faults() -> int:
    """This thread's minor page faults so far (``getrusage(RUSAGE_THREAD)``; 0 where the platform lacks it)."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    return resource.getrusage(who).ru_minflt if who is not None else 0


def _counted(fn: Callable[[], None], into: list[int]) -> Callable[[], None]:
    """``fn`` that appends the minor page faults each call took to ``into``."""
    def run() -> None:
        before = minor_faults()
        fn()
        into.append(minor_faults() - before)
    return run


def _hook_row(rec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    t_plain, t_hooked = statistics.median(rec["plain"]), statistics.median(rec["hooked"])
    return {"model": rec["model"], "strategy": rec["strategy"], "plain_ms": t_plain, "attached_ms": t_hooked,
            "extra_ms": t_hooked - t_plain, **ratio_fields(rec["hooked"], rec["plain"]), "rounds": len(rec["plain"]),
            **rec["memory"], **extra}


def _child(job: dict[str, Any], env: dict[str, str], what: str) -> Any:
    """``job`` run by ``python -m experiments.bench.steps`` in a fresh interpreter with ``env`` (and
    this process's torch thread count); what it printed last, parsed. ``what`` names the process in
    the one-line error a failed run raises."""
    done = subprocess.run([sys.executable, "-m", "experiments.bench.steps"],
                          input=json.dumps({**job, "threads": torch.get_num_threads()}), capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"bench {what} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pooled(repeats: int, models: tuple[str, ...], processes: int) -> list[dict[str, Any]]:
    """:func:`hook_times` in ``processes`` fresh interpreters (``python -m experiments.bench.steps``,
    one after the other, so they never share the cores), ``ceil(repeats / processes)`` rounds each
    on the thread-time clock, pooled per row: once with glibc's heap held (:data:`HOOK_MALLOC`: the
    row's ratio) and once with its defaults (``ratio_default``); each with the minor page faults per
    step of either side (``faults_*``: medians over the pooled rounds)."""
    job = {"section": "c", "repeats": math.ceil(repeats / processes), "models": list(models)}
    default_env = {k: v for k, v in os.environ.items() if k not in HOOK_MALLOC}
    pooled = {}
    for setting, env in (("held", {**default_env, **HOOK_MALLOC}), ("default", default_env)):
        runs = [_child(job, env, "(c): a pooled process") for _ in range(processes)]
        pooled[setting] = [{**recs[0], **{k: [x for r in recs for x in r[k]] for k in ("plain", "hooked")},
                            "faults": {k: [x for r in recs for x in r["faults"][k]] for k in ("plain", "hooked")},
                            "process_ratios": [paired_ratio(r["hooked"], r["plain"]) for r in recs]}
                           for recs in zip(*runs)]
    rows = []
    for held, default in zip(pooled["held"], pooled["default"]):
        rows.append(_hook_row(held, processes=processes, process_ratios=held["process_ratios"],
                              faults_plain=statistics.median(held["faults"]["plain"]),
                              faults_attached=statistics.median(held["faults"]["hooked"]),
                              ratio_default=paired_ratio(default["hooked"], default["plain"]),
                              process_ratios_default=default["process_ratios"],
                              faults_plain_default=statistics.median(default["faults"]["plain"]),
                              faults_attached_default=statistics.median(default["faults"]["hooked"])))
    return rows


EVERY = ((1, 1.0), (4, 1.0), (16, 1.0), (1, 0.5), (1, 0.25))
"""Section (e)'s ``(stats_every, stats_layers)`` settings (``layerwise`` takes only ``stats_layers = 1``)."""
EVERY_ROUNDS = 25
"""Section (e)'s rounds at least (``scalelab-bench`` without ``--quick`` or ``--repeats``): at 7 rounds the 95 %
interval of a ratio spanned 0.03-0.10 (its order statistics are then the extremes); 25 rounds take
~3 min (a round is 16 steps of every copy)."""


def bench_every(repeats: int, every: tuple[tuple[int, float], ...] = EVERY, block: int = 16,
                held: bool = False) -> list[dict[str, Any]]:
    """(e) The attached rules on the MLP with ``stats_every = k`` and ``stats_layers = q``: per
    round, ``block`` training steps (so each k's share of statistic steps, 1/k, is in every timing)
    of the plain copy and of an attached copy per setting, side by side; the ratio is
    attached(k, q) / plain in the same round. ``held``: in one fresh interpreter with glibc's heap
    held (:data:`HOOK_MALLOC`), as (c)'s ratio; else in this process."""
    if held:
        env = {**os.environ, **HOOK_MALLOC}
        job = {"section": "e", "repeats": repeats, "every": [list(e) for e in every], "block": block}
        rows = _child(job, env, "(e): its process")
        return [{**r, "held": True} for r in rows]
    model, loss_of = _mlp()
    rows = []
    for label, kw in HOOKED.items():
        name = "layerwise" if label.startswith("layerwise") else label
        settings = [(k, q) for k, q in every if q == 1.0 or name != "layerwise"]
        copies = {"plain": (model, strategies.create(name, **kw))}
        for k, q in settings:
            m = copy.deepcopy(model)
            copies[f"{k},{q}"] = (m, strategies.create(name, **kw, stats_every=k, stats_layers=q).attach(m))
        opts = {key: NoOpOptimizer(list(m.parameters())) for key, (m, _) in copies.items()}

        def steps(key: str) -> None:
            m, s = copies[key]
            for _ in range(block):
                train_step(m, s, opts[key], loss_of)

        t = paired_ms({key: (lambda key=key: steps(key)) for key in copies}, repeats, clock=time.thread_time)
        for key, (_, s) in copies.items():
            s.detach()
        rows += [{"strategy": label, "stats_every": k, "stats_layers": q,
                  "plain_ms": statistics.median(t["plain"]) / block,
                  "attached_ms": statistics.median(t[f"{k},{q}"]) / block,
                  **ratio_fields(t[f"{k},{q}"], t["plain"])} for k, q in settings]
    return rows


def interval_text(row: dict[str, Any]) -> str:
    """A row's 95 % interval of its median ratio (:func:`experiments.bench.common.median_interval`)
    as ``[lo, hi]``; ``-`` where the rounds are too few for one."""
    lo, hi = row.get("ratio_lo", math.nan), row.get("ratio_hi", math.nan)
    return "-" if math.isnan(lo) or math.isnan(hi) else f"[{lo:.3f}, {hi:.3f}]"


def table(head: list[str], cols: list[tuple[str, str, int, str]], rows: list[dict[str, Any]]) -> str:
    """``head`` lines, then one column per ``(header, key, width, format)`` (format ``"s"``: left
    aligned text; ``"x"``: a ratio; ``"i"``: the row's :func:`interval_text`), one line per row."""
    def cell(r: dict[str, Any], key: str, w: int, f: str) -> str:
        if f == "i":
            return f"{interval_text(r):>{w}}"
        return f"{r[key]:<{w}}" if f == "s" else f"{r[key]:>{w - 1}.2f}x" if f == "x" else f"{r[key]:>{w}{f}}"

    header = "".join(f"{h:<{w}}" if f == "s" else f"{h:>{w}}" for h, _, w, f in cols)
    lines = [*head, "", "  " + header, "  " + "-" * len(header)]
    return "\n".join(lines + ["  " + "".join(cell(r, k, w, f) for _, k, w, f in cols) for r in rows])


def format_every(rows: list[dict[str, Any]]) -> str:
    where = (["    one fresh process with glibc's heap held, as (c)'s ratio: compare its rows with each other, not with (c)"]
             if rows and rows[0].get("held") else [])
    return table(["(e) statistics every k steps (stats_every) and of a share q of the layers (stats_layers): the attached",
                   "    rules on the MLP, blocks of 16 training steps; median CPU ms (thread_time) per step; ratio: median over rounds of",
                   "    attached(k, q) / plain in the same round, and its 95 % interval (distribution-free, order statistics)", *where],
                  [("strategy", "strategy", 20, "s"), ("k", "stats_every", 4, "d"), ("q", "stats_layers", 6, ".2f"),
                   ("plain", "plain_ms", 10, ".3f"), ("attached", "attached_ms", 12, ".3f"), ("ratio", "ratio", 9, ".3f"),
                   ("95% interval", "ratio", 18, "i")],
                  rows)


def bench_fused(params: list[torch.nn.Parameter], master: list[torch.Tensor], names: list[str],
                repeats: int) -> list[dict[str, Any]]:
    """Per strategy: a separate unscale_() then the fused step, against the fused step unscaling
    itself (the strategy only reads the gradients: every rule but the per-group ones), and
    ``torch.amp.GradScaler``'s own fused path in the same rounds (``vs_gradscaler``: median over
    rounds of fused / GradScaler's fused); all share one optimizer (lr 0: the parameters never move)."""
    opt = torch.optim.AdamW(params, lr=0.0, fused=True)
    loss = torch.ones((), requires_grad=True)
    reference = torch.amp.GradScaler("cpu")
    rows = []
    for name in names:
        if name == "none":
            continue
        scaler = make_scaler(name)

        def run(scaler: Any, unscale_first: bool) -> None:
            torch._foreach_copy_([p.grad for p in params], master)
            scaler.scale(loss)
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

        t = paired_ms({"separate": lambda: run(scaler, True), "fused": lambda: run(scaler, False),
                       "gradscaler": lambda: run(reference, False)}, repeats)
        t_sep, t_fused = statistics.median(t["separate"]), statistics.median(t["fused"])
        rows.append({"strategy": name, "unscale_then_step_ms": t_sep, "fused_ms": t_fused, "saved_ms": t_sep - t_fused,
                     "vs_gradscaler": paired_ratio(t["fused"], t["gradscaler"])})
    return rows


def format_hooks(rows: list[dict[str, Any]]) -> str:
    rounds = f"{rows[0]['rounds']} rounds" if rows and "rounds" in rows[0] else "rounds"
    procs = rows[0].get("processes", 1) if rows else 1
    spread = [f"    same round (target: <= 1.050), and its 95 % interval (distribution-free, order statistics)"]
    cols = [("model", "model", 6, "s"), ("strategy", "strategy", 20, "s"), ("plain", "plain_ms", 10, ".3f"),
            ("attached", "attached_ms", 12, ".3f"), ("extra", "extra_ms", 10, ".3f"), ("ratio", "ratio", 9, ".3f"),
            ("95% interval", "ratio", 18, "i")]
    if procs > 1:
        spread = [f"    same round (target: <= 1.050), and its 95 % interval (distribution-free, order statistics); the rounds",
                  f"    come from {procs} fresh processes, pooled (a ratio moves between processes by more than one process's",
                  "    interval); per process: the lowest and highest of their own median ratios. These run with glibc's heap",
                  "    held (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB): with its defaults, whether free()",
                  "    hands the heap's top back and the next step faults it in again depends on each process's heap layout;",
                  f"    'glibc default': {procs} more processes' pooled ratio and range under glibc's defaults; faults: minor",
                  "    page faults per step, plain/attached (median over the pooled rounds)"]
        rows = [{**r, "per_process": _range(r["process_ratios"]), "per_process_default": _range(r["process_ratios_default"]),
                 "faults": f"{r['faults_plain']:.0f}/{r['faults_attached']:.0f}",
                 "faults_default": f"{r['faults_plain_default']:.0f}/{r['faults_attached_default']:.0f}"} for r in rows]
        cols += [("per process", "per_process", 14, ""), ("faults", "faults", 9, ""),
                 ("glibc default", "ratio_default", 15, ".3f"), ("per process", "per_process_default", 14, ""),
                 ("faults", "faults_default", 10, "")]
    return table(["(c) attach-based rules, attached vs not, per training step of an 8 x 512 MLP (batch 256) and of a",
                   "    4-block character GPT (width 128, batch 16 x 64): forward + scaled backward + unscale_/step",
                   f"    (no-op)/update, median CPU ms (thread_time); ratio: median over {rounds} of attached / plain in the",
                   *spread], cols, rows)


def _range(ratios: list[float]) -> str:
    return f"{min(ratios):.3f}-{max(ratios):.3f}"


def format_fused(rows: list[dict[str, Any]], size: str) -> str:
    return table([f"(d) AdamW(fused=True) at {size}: unscale_() then step vs the optimizer unscaling itself (the strategy",
                   "    only reads the gradients), median ms; vs GradScaler: median over rounds of fused / GradScaler's",
                   "    own fused path in the same round"],
                  [("strategy", "strategy", 20, "s"), ("unscale_+step", "unscale_then_step_ms", 15, ".3f"),
                   ("fused", "fused_ms", 10, ".3f"), ("saved", "saved_ms", 10, ".3f"),
                   ("vs GradScaler", "vs_gradscaler", 15, "x")], rows)


if __name__ == "__main__":  # one fresh process of section (c) or (e) (_child): a JSON job on stdin, the result on stdout
    _job = json.loads(sys.stdin.read())
    if _job["section"] == "e":
        torch.set_num_threads(_job["threads"])
        print(json.dumps(bench_every(_job["repeats"], tuple(tuple(e) for e in _job["every"]), _job["block"])))
    else:
        print(json.dumps(hook_times(_job["repeats"], tuple(_job["models"]), threads=_job["threads"])))
