"""``docs/replay.md`` from the results of :mod:`experiments.replay.check` (every number on it is
computed here from ``results.json``; nothing is typed by hand)."""

from __future__ import annotations

from pathlib import Path
from statistics import mean, median
from typing import Any

from experiments.app.records import write_text_atomic
from strategies.tracing.inputs import NEAR, RECENT

__all__ = ["TARGET", "page", "write"]

TARGET = 0.95
"""The share of steps, up to the first skip difference, whose replayed scale is within 2x of the real one."""
MODEL = "auto"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else (f"{x:.0f}" if isinstance(x, float) else str(x))


def _others(rows: list[dict]) -> list[dict]:
    """The pairs whose target is not their source (a rule on its own trace is the identity check)."""
    return [r for r in rows if r["target"] != r["source"]]


def _before(r: dict, model: str = MODEL) -> float:
    """Share within 2x up to the first difference; a pair that differs at its first step has none: 0."""
    v = r[model]["within_before"]
    return 0.0 if v is None else v


def _summary(rows: list[dict]) -> list[str]:
    out = ["| strategy | pairs | pairs >= 95% | within 2x before the first diff (mean / min) | first diff (median step) "
           "| within 2x after it (mean) | useful steps after it (median) | skipped: replay / real (total) |",
           "|---|---|---|---|---|---|---|---|"]
    for target in sorted({r["target"] for r in rows}):
        rs = [r for r in _others(rows) if r["target"] == target]
        if not rs:
            continue
        m = [r[MODEL] for r in rs]
        diffs = [x["first_diff"] for x in m if x["first_diff"] is not None]
        after = [x["within_after"] for x in m if x["within_after"] is not None]
        useful = [x["useful_after"] for x in m if x["useful_after"] is not None]
        ok = sum(_before(r) >= TARGET for r in rs)
        out.append(f"| {target} | {len(rs)} | {ok} | {_pct(mean(_before(r) for r in rs))} / {_pct(min(_before(r) for r in rs))} "
                   f"| {_num(median(diffs)) if diffs else 'never'} ({len(m) - len(diffs)} never) | "
                   f"{_pct(mean(after)) if after else '-'} | {_num(median(useful)) if useful else '-'} | "
                   f"{sum(x['skipped_replay'] for x in m)} / {sum(x['skipped_real'] for x in m)} |")
    return out


def _overall(rows: list[dict], model: str) -> float:
    """Mean over the pairs of the share of all steps whose replayed scale is within 2x of the real one."""
    return mean((_before(r, model) * ((r[model]["first_diff"] or r[model]["steps"] + 1) - 1) +
                 (r[model]["within_after"] or 0) * (r[model]["steps"] + 1 - (r[model]["first_diff"] or r[model]["steps"] + 1)))
                / max(r[model]["steps"], 1) for r in _others(rows))


def _models(rows: list[dict]) -> list[str]:
    out = ["| overflow model | pairs >= 95% | within 2x before the first diff (mean) | pairs whose skips never differ | "
           "within 2x over all steps (mean) | skipped steps: replay / real (total) |", "|---|---|---|---|---|---|"]
    rs = _others(rows)
    for model in ("auto", "persist", "bound"):
        never = sum(r[model]["first_diff"] is None for r in rs)
        out.append(f"| {model} | {sum(_before(r, model) >= TARGET for r in rs)} of {len(rs)} | "
                   f"{_pct(mean(_before(r, model) for r in rs))} | {never} of {len(rs)} | {_pct(_overall(rows, model))} | "
                   f"{sum(r[model]['skipped_replay'] for r in rs)} / {sum(r[model]['skipped_real'] for r in rs)} |")
    return out


def _court(results: dict[str, Any]) -> list[str]:
    """The overflow models on the court's natural runs, and the default's reason, from the numbers."""
    rows, court = results["rows"], results.get("court") or []
    if not court:
        return [f"No court runs under `{results.get('court_dir', 'runs/court')}` (`make court`): the overflow models "
                "are compared on the spikes and tiny_grad pairs only."]
    cells = sorted({r["source"] for r in court})
    return [
        f"On natural runs: the court's (`make court`, `{results['court_dir']}`: GRPO `rl` and `finetune` on the "
        f"pretrained character GPT, 800 steps; seeds {results['court_seeds']}), every fp16 preset cell ({', '.join(cells)}) "
        "replayed on every other cell's trace against that cell's real run. Their overflows are the scale's own: "
        "`areal` grows every 5 steps, and `megatron`, `areal` and `init_2p32` open at 2^32 and halve through a "
        "string of overflows.", "", *_models(court), "",
        f"Why `auto` is the default: on the spikes (overflows that are jumps) it matches `persist` up to the first "
        f"skip difference and trails it over all steps ({_pct(_overall(rows, 'auto'))} against "
        f"{_pct(_overall(rows, 'persist'))}), while on the court's natural runs `persist` turns every growth overflow "
        f"into a skip of the replayed preset ({_pct(_overall(court, 'persist'))} within 2x over all steps against "
        f"`auto`'s {_pct(_overall(court, 'auto'))}); `bound` is the reverse ({_pct(_overall(court, 'bound'))} on the "
        f"court, {_pct(_overall(rows, 'bound'))} on the spikes). `auto` is the one model near the best on both: it "
        "tells the two kinds of overflow apart from the gradients around them.",
    ]


def _detail(rows: list[dict], workload: str) -> list[str]:
    out = [f"### {workload}", "", "| strategy | source | seed | steps | first diff | within 2x before / after | "
           "useful after | skipped replay / real |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["workload"] == workload), key=lambda r: (r["target"], r["source"], r["seed"])):
        m = r[MODEL]
        out.append(f"| {r['target']} | {r['source']} | {r['seed']} | {m['steps']} | {_num(m['first_diff']) if m['first_diff'] else 'never'} "
                   f"| {_pct(m['within_before'])} / {_pct(m['within_after'])} | {_num(m['useful_after'])} | "
                   f"{m['skipped_replay']} / {m['skipped_real']} |")
    return out


def _below(rows: list[dict]) -> list[str]:
    """The pairs under the target, and why a replay can miss with no skip difference at all."""
    low = [r for r in _others(rows) if _before(r) < TARGET]
    if not low:
        return ["None."]
    out = [f"* {r['workload']}: `{r['target']}` on `{r['source']}`'s trace, {_pct(_before(r))} within 2x "
           f"({'no' if r[MODEL]['first_diff'] is None else 'a'} skip difference)" for r in low]
    return out + ["", "Where the skip decisions never differ, the scales drift apart because the gradients do: a rule "
                  "whose scale follows the gradients' size (`amax_history`, `te_delayed`, `underflow_target`) reads "
                  "the *recorded* run's gradients, and under underflow (`tiny_grad`) the gradient itself depends on "
                  "the scale (the entries flushed to zero), so a different scale trains different weights. A replay "
                  "is exact only as far as the recorded gradients stay those the replayed rule would have seen."]


def _sizes(sizes: list[dict]) -> list[str]:
    per = [s["bytes"] / s["steps"] for s in sizes if s["steps"]]
    glob = [s["bytes"] / s["steps"] for s in sizes if s["scale_groups"] == 1]
    grp = [s["bytes"] / s["steps"] for s in sizes if s["scale_groups"] > 1]
    lines = [f"Measured on the {len(sizes)} runs above (`trace.jsonl` bytes / steps; a histogram every 5 steps): "
             f"median {median(per):.0f} B per step, max {max(per):.0f} B, i.e. {median(per) * 1e5 / 1e6:.1f} MB "
             f"(max {max(per) * 1e5 / 1e6:.1f} MB) per 100k steps."]
    if glob and grp:
        lines.append(f"Global-scale strategies {median(glob):.0f} B per step, per-layer ones (a scale per group) "
                     f"{median(grp):.0f} B.")
    return lines


def page(results: dict[str, Any]) -> str:
    rows = results["rows"]
    rs = _others(rows)
    self_exact = all(r[MODEL]["first_diff"] is None and r[MODEL]["within_before"] == 1.0
                     for r in rows if r["target"] == r["source"])
    ok = sum(_before(r) >= TARGET for r in rs)
    text = [
        "# Replay against real runs", "",
        "Generated by `make replay-check` (`python -m experiments.replay.check`); do not edit. "
        "What a replay is and what it cannot know: `scalelab-replay --help`, `strategies/tracing/replay.py`, "
        "and the overflow model in `strategies/tracing/inputs.py`.", "",
        "## Use", "",
        "Every run of the app writes `trace.jsonl` (`docs/run-records.md`); any other loop writes one with "
        "`strategies.watch.Watch(...).save(path)` (`docs/early-warning.md`). Then:", "",
        "```",
        "scalelab-replay runs/my_run --strategy megatron                  # a preset, through its YAML",
        "scalelab-replay runs/my_run --strategy native --set growth_interval=500 --set hysteresis=2",
        "scalelab-replay runs/my_run --strategy all                       # every option, one paragraph each",
        "scalelab-replay runs/my_run --strategy max_ema --json            # one object per step: step, scale, skipped",
        "scalelab-replay runs/compare --table                             # replay.json in each failed run: the report's table",
        "```", "",
        "or in Python `strategies.tracing.replay(Trace.from_lines(open(path)), strategy)`. The text says which steps "
        "it would skip, the scale's changes, its lowest scale and whether it reaches its floor, and (from the "
        "histograms) the activation-gradient entries it would lose to underflow. `--overflow` picks how a step that "
        "overflowed in the recorded run behaves at another scale (below: `auto`, the default, `persist` or `bound`). "
        "A rule whose input no trace holds (an fp32 probe, per-group activation statistics) says so and is not "
        "replayed.", "",
        "## Against real runs", "",
        "Each strategy option is replayed on the trace of a *source* run (`native` or `max_ema`) and compared with a "
        "real run of it on the same workload and seed. *First diff*: the first step where the replay's skip decision "
        "differs from the real run's (after it, the real run's weights are no longer the recorded ones). *Within 2x*: "
        "the share of steps whose replayed loss-side scale is within a factor of 2 of the real one, before and after "
        f"that step (target: {100 * TARGET:.0f}% before). *Useful after*: steps past the first difference until the "
        "replayed scale first leaves 2x.", "",
        f"Workloads (each `{' '.join(results['base'])}` plus): " +
        "; ".join(f"**{w}** `{' '.join(o)}`" for w, o in results["workloads"].items()) +
        f". Seeds {results['seeds']}, sources {results['sources']}.", "",
        f"**Result**: {ok} of {len(rs)} pairs (source != target) reach {100 * TARGET:.0f}% within 2x up to the first "
        f"skip difference; a rule replayed on its own trace retraces it exactly: {'yes' if self_exact else 'NO'} "
        f"({sum(1 for r in rows if r['target'] == r['source'])} pairs). Cost: this command took "
        f"{results['minutes']:.1f} min ({results['trained']} of {results['runs']} runs trained in it, one CPU thread); "
        f"a replay of one run takes {1000 * median(r[MODEL]['seconds'] for r in rows):.0f} ms (median; slowest "
        f"{1000 * max(r[MODEL]['seconds'] for r in rows):.0f} ms).", "",
        f"## Per strategy (overflow model `{MODEL}`, the default)", "", *_summary(rows), "",
        "## The overflow models", "",
        "A step that overflowed in the source run: `persist` says it overflows at any scale, `bound` only at the "
        f"recorded scale or above, `auto` the first where the gradients of the {RECENT} steps before were far from "
        f"overflowing at that scale (a jump), the second where they were at the edge, `max a * S >= {NEAR} M` (the scale "
        "overflowed: a GradScaler growth step; a run that opens with overflows is judged by the clean steps after "
        "them). These source traces hold no growth overflow (`native` grows every 2000 steps, over this check's 150; "
        "`max_ema` rides at M/2 by design): on the spikes and tiny_grad pairs,", "",
        *_models(rows), "", *_court(results), "",
        "## Below the target", "", *_below(rows), "",
        "## Not replayable", "", *(f"* `{k}`: {v}" for k, v in sorted(results["missing"].items())), "",
        "## Trace size", "", *_sizes(results["sizes"]), "",
        "## Every pair", "",
    ]
    for w in results["workloads"]:
        text += [*_detail(rows, w), ""]
    return "\n".join(text)


def write(path: Path, results: dict[str, Any]) -> None:
    write_text_atomic(path, page(results))
