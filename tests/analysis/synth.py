"""Synthetic run records with known differences, in the exact format of docs/run-records.md.

``write_sweep`` lays out a Hydra-multirun-like directory (``<root>/<job>/.hydra/overrides.yaml``,
``summary.json``, ``metrics.jsonl``) whose final eval losses are drawn from known normal
distributions, so tests can check rankings, intervals and p-values against the truth. Optional
extras add one run of every awkward kind: failed, diverged, still running with a truncated
(corrupt) last line, and a Hydra job that wrote nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LAYERS = ("fc1", "fc2", "head")
MODEL, DATA, REGIME = "mlp", "synthetic", "plain"
WORKLOAD = f"{MODEL}/{DATA}/{REGIME}"

#: Default true mean final eval loss per strategy at fp16 (lower is better): max_ema < layerwise
#: < native < none, separated by many standard deviations (sd 0.01).
TRUE_LOSS = {"max_ema": 0.50, "layerwise": 0.60, "native": 0.70, "none": 0.90}

#: Default true mean lost gradient fraction per strategy (fidelity lines, when written).
TRUE_LOST = {"max_ema": 1e-4, "layerwise": 1e-3, "native": 0.02, "none": 0.9}


@dataclass
class SweepSpec:
    """What to write. ``true_loss`` maps strategy → mean final eval loss at each precision in
    ``precisions``; an fp32 reference (strategy ``none``) is added when ``fp32_reference``."""

    true_loss: dict[str, float] = field(default_factory=lambda: dict(TRUE_LOSS))
    precisions: tuple[str, ...] = ("fp16",)
    seeds: int = 3
    sd: float = 0.01
    steps: int = 40
    log_every: int = 5
    eval_every: int = 20
    fp32_reference: bool = True
    extras: bool = True
    rng_seed: int = 1234
    #: Exact final eval losses per (strategy, precision), one per seed, instead of draws (for
    #: paired designs: seed effects shared across strategies).
    finals: dict[tuple[str, str], list[float]] | None = None
    #: Write a kind-"fidelity" line every this many steps (0: none) with lost fraction drawn
    #: around ``true_lost[strategy]`` (fp32 runs: 0) and 1 − cosine around a tenth of it.
    fidelity_every: int = 0
    true_lost: dict[str, float] = field(default_factory=lambda: dict(TRUE_LOST))
    #: Strategies that skip (back off at) the first two logged steps.
    skipping: tuple[str, ...] = ("native",)


def _scale_path(strategy: str, spec: SweepSpec, rng: np.random.Generator
                ) -> tuple[list[float], list[bool]]:
    """(scale after update, skipped) at each logged step: native (``spec.skipping``) backs off
    twice early."""
    scales, skipped = [], []
    s = 65536.0 if strategy in ("native", "layerwise") else 1.0
    log_every = spec.log_every
    for step in range(log_every, spec.steps + 1, log_every):
        skip = strategy in spec.skipping and step in (log_every, 2 * log_every)
        if strategy == "native":
            s = s / 2 if skip else s
        elif strategy == "max_ema":
            s = 2.0 ** round(12 + rng.normal(0, 0.3))
        scales.append(s)
        skipped.append(skip)
    return scales, skipped


def _run_lines(strategy: str, precision: str, final: float, spec: SweepSpec,
               rng: np.random.Generator, stop_at: int | None = None) -> list[dict]:
    lines: list[dict] = []
    scales, skipped = _scale_path(strategy, spec, rng)
    total_skipped = 0
    underflow = {"none": 0.30, "native": 0.08, "layerwise": 0.05, "max_ema": 0.06}.get(strategy, 0.1)
    if precision == "fp32":
        underflow = 0.02
    last = min(stop_at or spec.steps, spec.steps)
    for i, step in enumerate(range(spec.log_every, last + 1, spec.log_every)):
        total_skipped += skipped[i]
        loss = final + (2.3 - final) * math.exp(-step / 10) + float(rng.normal(0, 0.01))
        scale = scales[i] if precision != "fp32" else 1.0
        line = {
            "kind": "train", "step": step, "loss": loss, "loss_avg": loss, "scale": scale,
            "skipped": skipped[i], "skipped_total": total_skipped,
            "grad_absmax": 0.5, "grad_norm": 1.0 + 0.01 * step,
            "grad_zero_frac": underflow / 2, "grad_subnormal_frac": 0.01,
            "act_zero_frac": {name: min(1.0, underflow * (k + 1)) for k, name in
                              enumerate(LAYERS)},
            "act_subnormal_frac": {name: 0.01 * (k + 1) for k, name in enumerate(LAYERS)},
            "lr": 0.01, "step_time_s": 0.010, "strategy_time_s": 0.001,
        }
        if strategy == "layerwise":
            line["scales"] = [scale * 2.0 ** -k for k in range(len(LAYERS))]
            line["scale_groups"] = list(LAYERS)
        if i % 2 == 0:
            centre = -20 + (math.log2(scale) if scale > 0 else 0)
            lo = -40
            expo = np.arange(lo, 20)
            counts = np.round(1000 * np.exp(-0.5 * ((expo - centre) / 4) ** 2)).astype(int)
            zeros = 0
            if precision == "fp16":  # below 2^-24 flushes to zero
                zeros = int(counts[expo < -24].sum())
                counts[expo < -24] = 0
            line["act_exp_hist"] = {"lo": lo, "counts": counts.tolist(), "zeros": zeros}
        lines.append(line)
        if spec.fidelity_every and step % spec.fidelity_every == 0:
            lines.append(_fidelity_line(strategy, precision, step, spec, rng))
        if step % spec.eval_every == 0 or step == spec.steps:
            lines.append({"kind": "eval", "step": step,
                          "eval_loss": final + (2.3 - final) * math.exp(-step / 10),
                          "eval_metric": 1.0 - final / 3})
    if lines and lines[-1]["kind"] == "eval":
        lines[-1]["eval_loss"] = final
    return lines


def _fidelity_line(strategy: str, precision: str, step: int, spec: SweepSpec,
                   rng: np.random.Generator) -> dict:
    lost = 0.0 if precision == "fp32" else spec.true_lost.get(strategy, 0.01)
    lost = float(np.clip(lost * np.exp(rng.normal(0, 0.1)), 0.0, 1.0))
    cos = 1.0 - lost / 10
    return {"kind": "fidelity", "step": step, "cosine": cos, "rel_err": lost / 5,
            "lost_frac": lost, "layer_cosine": {name: cos for name in LAYERS},
            "layer_rel_err": {name: lost / 5 for name in LAYERS},
            "layer_lost_frac": {name: lost for name in LAYERS}, "fidelity_probe_s": 0.002}


def _summary(strategy: str, precision: str, seed: int, final: float | None, status: str,
             spec: SweepSpec, skipped: int, steps: int, error: str | None = None,
             overhead_frac: float = 0.1) -> dict:
    return {
        "status": status, "error": error, "strategy": strategy, "precision": precision,
        "model": MODEL, "data": DATA, "regime": REGIME, "workload": WORKLOAD, "seed": seed,
        "sweep": "synthetic", "steps": steps, "final_train_loss": final,
        "final_eval_loss": final, "best_eval_loss": final, "final_eval_metric":
            None if final is None else 1.0 - final / 3,
        "skipped_steps": skipped, "mean_step_time_s": 0.01,
        "strategy_overhead_s": 0.01 * overhead_frac, "strategy_overhead_frac": overhead_frac,
        "diverged": status == "diverged",
        "fingerprint": {"git_sha": "0" * 40, "git_dirty": False, "config": {},
                        "overrides": [f"strategy={strategy}", f"precision={precision}",
                                      f"seed={seed}"],
                        "torch_version": "2.13.0", "device": "cpu", "hostname": "test"},
    }


def _write_job(root: Path, job: int, overrides: list[str], summary: dict | None,
               lines: list[dict], trailing: str = "") -> Path:
    run_dir = root / str(job)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides), encoding="utf-8")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    if lines or trailing:
        with (run_dir / "metrics.jsonl").open("w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(json.dumps(line) + "\n")
            fh.write(trailing)
    return run_dir


#: Overhead fraction per strategy in the synthetic data (native cheapest).
OVERHEAD = {"native": 0.02, "max_ema": 0.05, "layerwise": 0.08, "none": 0.0}


def write_sweep(root: str | Path, spec: SweepSpec | None = None) -> dict[str, object]:
    """Write a synthetic sweep under ``root``; return what was written (true values, extras).

    Returned keys: ``finals`` — {(strategy, precision): [final eval loss per seed]},
    ``n_runs`` — run directories written, ``extras`` — {kind: run dir name}.
    """
    spec = spec or SweepSpec()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n", encoding="utf-8")
    rng = np.random.default_rng(spec.rng_seed)
    finals: dict[tuple[str, str], list[float]] = {}
    job = 0
    cells = [(s, p, mu) for p in spec.precisions for s, mu in spec.true_loss.items()]
    if spec.fp32_reference:
        cells.append(("none", "fp32", min(spec.true_loss.values()) - 0.05))
    if spec.finals is not None:
        cells = [(s, p, float("nan")) for (s, p) in spec.finals]
    for strategy, precision, mu in cells:
        for seed in range(spec.seeds):
            final = (float(rng.normal(mu, spec.sd)) if spec.finals is None
                     else spec.finals[(strategy, precision)][seed])
            finals.setdefault((strategy, precision), []).append(final)
            lines = _run_lines(strategy, precision, final, spec, rng)
            skipped = sum(1 for ln in lines if ln.get("skipped"))
            summary = _summary(strategy, precision, seed, final, "completed", spec, skipped,
                               spec.steps, overhead_frac=OVERHEAD.get(strategy, 0.05))
            probes = [ln for ln in lines if ln["kind"] == "fidelity"]
            if probes:
                summary["fidelity_lost_frac_mean"] = float(np.mean([p["lost_frac"]
                                                                    for p in probes]))
                summary["fidelity_one_minus_cos_mean"] = float(np.mean([1 - p["cosine"]
                                                                        for p in probes]))
            _write_job(root, job, [f"strategy={strategy}", f"precision={precision}",
                                   f"seed={seed}"], summary, lines)
            job += 1
    extras: dict[str, str] = {}
    if spec.extras:
        p = spec.precisions[0]
        # failed: an exception after a few steps
        lines = _run_lines("max_ema", p, 0.5, spec, rng, stop_at=10)
        _write_job(root, job, ["strategy=max_ema", f"precision={p}", "seed=99"],
                   _summary("max_ema", p, 99, None, "failed", spec, 0, 10,
                            error="RuntimeError: synthetic failure for the test"), lines)
        extras["failed"] = str(job)
        job += 1
        # diverged: loss blew up
        lines = _run_lines("none", p, 0.9, spec, rng, stop_at=15)
        lines[-1]["loss"] = float("inf")
        _write_job(root, job, ["strategy=none", f"precision={p}", "seed=98"],
                   _summary("none", p, 98, float("nan"), "diverged", spec, 0, 15), lines)
        extras["diverged"] = str(job)
        job += 1
        # incomplete: summary still 'running', last metrics line cut mid-write
        lines = _run_lines("native", p, 0.7, spec, rng, stop_at=20)
        _write_job(root, job, ["strategy=native", f"precision={p}", "seed=97"],
                   _summary("native", p, 97, None, "running", spec, 0, 0), lines,
                   trailing='{"kind": "train", "step": 25, "loss": 0.7')
        extras["incomplete"] = str(job)
        job += 1
        # a Hydra job that died before writing any record
        _write_job(root, job, ["strategy=layerwise", f"precision={p}", "seed=96"], None, [])
        extras["no_records"] = str(job)
        job += 1
    return {"finals": finals, "n_runs": job, "extras": extras}
