"""``docs/early-warning.md`` and ``strategies/watch/fitted.py`` from the results of
:mod:`experiments.warning.evaluate` (every number computed here; nothing typed by hand)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from experiments.warning.data import COMMON, NEAR, SEEDS, STRATEGIES, TRAIN_SEEDS, WORKLOADS

__all__ = ["fitted_module", "page"]

TARGETS = {"auroc": 0.9, "false_alarms": 0.05}


def fitted_module(model: dict[str, Any]) -> str:
    """The Python module holding the fitted coefficients (the library ships them as data)."""
    return ('"""The early-warning model\'s coefficients, written by ``make warning-eval``\n'
            '(``experiments/warning/evaluate.py``; ``docs/early-warning.md``). Do not edit."""\n\n'
            '__all__ = ["MODEL"]\n\nMODEL = ' + json.dumps(model, indent=4) + "\n")


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "-"


def _alarms_within(e: dict[str, Any]) -> bool:
    """An evaluation's false alarms within the target share of its healthy runs."""
    return e["false_alarms"] <= TARGETS["false_alarms"] * e["healthy"]


def _row(name: str, e: dict[str, Any]) -> str:
    lead = "-" if e["lead_median"] is None else f"{100 * e['lead_median']:.0f}%"
    ok = (e["auroc"] >= TARGETS["auroc"], _alarms_within(e))
    return (f"| {name} | {e['failing']} / {e['healthy']} | {e['auroc']:.3f} | {_pct(e['detected'], e['failing'])} | {lead} "
            f"| {_pct(e['false_alarms'], e['healthy'])} | {'met' if all(ok) else 'missed: ' + ', '.join(n for n, o in zip(('AUROC', 'false alarms'), ok) if not o)} |")


def _model(model: dict[str, Any]) -> list[str]:
    out = ["| feature | mean (training) | sd | coefficient (per sd) |", "|---|---|---|---|"]
    for f, m, s, c in zip(model["features"], model["mean"], model["scale"], model["coef"]):
        out.append(f"| `{f}` | {m:.3g} | {s:.3g} | {c:+.3f} |")
    return out + ["", f"Intercept {model['intercept']:+.3f}; threshold {model['threshold']:.3f} (score = sigmoid of the "
                      "intercept plus each coefficient times its standardised feature)."]


def _data(runs: list[dict]) -> list[str]:
    out = ["| workload | failing twin: overrides | outcomes (failing twin) | outcomes (healthy twin, lr / 10) | "
           f"outcomes (near-edge, lr / {NEAR}) | failing step (median) |", "|---|---|---|---|---|---|"]

    def outcomes(rs: list[dict]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(Counter(r["status"] for r in rs).items())) or "-"

    for w, (shared, lr) in WORKLOADS.items():
        rs = [r for r in runs if r["workload"] == w]
        near = [r for r in rs if r.get("near")]
        twins = [r for r in rs if not r.get("near")]
        ends = sorted(r["end"] for r in rs if r["status"] != "completed")
        out.append(f"| {w} | `{' '.join(shared + lr)}` | {outcomes([r for r in twins if r['failing']])} | "
                   f"{outcomes([r for r in twins if not r['failing']])} | {outcomes(near)} | "
                   f"{ends[len(ends) // 2] if ends else '-'} |")
    return out


def _data_cost(results: dict[str, Any]) -> str:
    n, cpu = results.get("data_cpu_known", 0), results.get("data_cpu_minutes")
    if not n or cpu is None:
        return ""
    return (f"; the labelled data cost {cpu:.1f} min of CPU to train ({n} of {len(results['runs'])} runs, each timed "
            "when it was trained: `costs.json` in the output folder)")


def _near(results: dict[str, Any]) -> list[str]:
    """The held-out seeds' model on the near-edge runs (absent from results written before them)."""
    n = results.get("near")
    if not n:
        return []
    held = ", ".join(str(s) for s in sorted(set(SEEDS) - set(TRAIN_SEEDS)))
    alarms = "; ".join(f"`{f['workload']}` seed {f['seed']} at step {f['step']} of {f['end']} ({f['reason']})"
                       for f in n["false_alarm_runs"])
    failed = ", ".join(f"`{f['workload']}` seed {f['seed']} ({f['strategy']}, {f['status']} at step {f['end']})"
                       for f in n["failed_runs"])
    return [
        "## Harder negatives: healthy runs nearer the edge", "",
        f"The healthy twins above train at a tenth of the failing learning rate, which makes them easy to tell apart. "
        f"Every seed runs again at **1/{NEAR}** of it: the training seeds' near-edge runs are fitted on with the twins "
        f"(as negatives where they stay healthy), and the held-out seeds' ({held}) are scored by the same model and "
        f"threshold: {n['healthy']} of {n['runs']} stayed healthy, skipping {n['skipped_steps']} steps between them.",
        "",
        f"* False alarms {_pct(n['false_alarms'], n['healthy'])} on them, "
        + ("within" if _alarms_within(n) else "**above**")
        + f" the target of {100 * TARGETS['false_alarms']:.0f}%" + (f": {alarms}." if alarms else "."),
        f"* AUROC {n['auroc']:.3f} of the held-out failing runs against them (at a lead of at least 20% of the "
        "horizon, as above).",
        (f"* {n['failed']} failed at 1/{NEAR} of the learning rate ({failed}); warned at a lead of at least 20%: "
         f"{_pct(n['failed_detected'], n['failed'])}." if n["failed"] else f"* None failed at 1/{NEAR} of the learning rate."),
        "",
    ]


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _reading(results: dict[str, Any]) -> list[str]:
    """What the fit and the numbers come to, computed from them."""
    m, runs, held = results["model"], results["runs"], results["seeds"]
    ranked = sorted(zip(m["coef"], m["features"]), reverse=True)
    unused = [f for c, f in ranked if c == 0]
    failed = Counter(r["status"] for r in runs if r["status"] in ("diverged", "stalled", "failed"))
    out = [f"* The fit leans on `{ranked[0][1]}` (coefficient {ranked[0][0]:+.2f} per sd)"
           + (f"; it gives no weight to {', '.join(f'`{f}`' for f in unused)}." if unused else ".")]
    out.append(f"* The labelled failures are {', '.join(f'{k} {v}' for k, v in sorted(failed.items()))} "
               "(`failed`: stopped at the scale floor, `on_min_scale: raise`).")
    out += [_missed(m_, "held-out seed") for m_ in results.get("missed", [])]
    out += [_missed(m_, "training seed") for m_ in results.get("missed_train", [])]
    for w, e in results["workloads"].items():
        if e["failing"] and 2 * e["detected"] < e["failing"]:
            out.append(f"* Held out as a whole workload, `{w}` is warned at a lead >= 20% in only "
                       f"{_pct(e['detected'], e['failing'])} of its failing runs (AUROC {e['auroc']:.3f}): fitted without "
                       f"it, the threshold ({e['threshold']:.3f}) sits above its scores until late — a new kind of failure "
                       "is ranked, not yet calibrated.")
    for f in held.get("false_alarm_runs", []):
        out.append(f"* False alarm (held-out seed): `{f['workload']}` seed {f['seed']} ({f['strategy']}), healthy to "
                   f"step {f['end']}, flagged at step {f['step']}: {f['reason']}.")
    out.append(f"* The held-out splits are small ({held['failing']} failing, {held['healthy']} healthy runs for the "
               "held-out seeds): one run moves a rate by a large step.")
    return out


def _missed(m_: dict[str, Any], split: str) -> str:
    alarm = "no alarm" if m_["alarm"] is None else f"its alarm at step {m_['alarm']}"
    twin = "" if m_.get("failing", True) else " (the healthy twin, which failed too)"
    room = "-" if m_.get("headroom_min") is None else f"{m_['headroom_min']:.2f}"
    return (f"* Not warned in time ({split}): `{m_['workload']}` seed {m_['seed']}{twin}, {m_.get('status', 'failed')} "
            f"at step {m_['end']}, {alarm}; up to 80% of its horizon {m_['skips_before']} skipped steps, `loss_rise` at "
            f"most {_g(m_['loss_rise'])}, `act_fill` at most {_g(m_.get('act_fill'))} (forward headroom at least {room} "
            "binades).")


def _targets(results: dict[str, Any]) -> list[str]:
    """Each target on the held-out seeds, met or missed, in words."""
    e = results["seeds"]
    rate = e["false_alarms"] / e["healthy"] if e["healthy"] else float("nan")
    a_ok, f_ok = e["auroc"] >= TARGETS["auroc"], rate <= TARGETS["false_alarms"]
    words = [f"AUROC {e['auroc']:.3f} at a lead of at least 20% of the horizon: "
             + ("target (>= 0.9) met." if a_ok else "target (>= 0.9) **missed**: the failing runs listed below as not "
                "warned in time score no higher than healthy runs at that lead."),
             f"False alarms {_pct(e['false_alarms'], e['healthy'])} on healthy held-out runs: "
             + ("target (<= 5%) met." if f_ok else "target (<= 5%) **missed**: the threshold let at most 5% of the "
                "healthy *training* runs alarm, and the held-out runs listed below as false alarms went past it.")]
    return [f"* {w}" for w in words]


def _features() -> list[str]:
    return [
        "Every step, from the telemetry a loop already has (the scale the step ran at, whether it was skipped, the loss, "
        "the unscaled gradient abs-max; in scalelab runs the trace, `docs/run-records.md`) and the forward activation "
        "abs-max (the trace's `act_absmax`: the largest finite entry of any leaf module's output in the low-precision "
        "forward, from forward hooks), six features over the last 16 steps (an expanding window: from the first step, over the steps "
        "so far; \"the last 8\" is the window's second half):", "",
        "* `skip_rate` — the skipped steps (overflows) of the window over 16 (steps before the first count as clean);",
        "* `scale_drop` — halvings of the scale below its peak so far (a scale heading for its floor);",
        "* `amax_growth` — log2 of the median gradient abs-max of the last 8 steps over its lowest such median so far "
        "(gradients growing again: attention logits, an FFN output, a rising learning rate);",
        "* `loss_rise` — ln of the mean loss of the last 8 steps over its lowest such mean so far;",
        "* `act_fill` — the largest forward activation abs-max of the last 8 steps over the format's max (65504 in "
        "fp16), in [0, 1]: `2^-headroom`, with headroom = log2(65504 / abs-max) the binades left before the forward "
        "overflows. A forward overflow shows nothing in the gradients before it happens (its loss is non-finite before "
        "any scaling); this is its precursor;",
        "* `act_growth` — log2 of the median forward abs-max of the last 8 steps over its lowest such median so far.", "",
        "Every labelled run below is a small character GPT trained on the CPU: how the activation features' scale "
        "carries over to other models is not measured here.", "",
    ]


def page(results: dict[str, Any]) -> str:
    header = ["| split | failing / healthy runs | AUROC at lead >= 20% | warned at lead >= 20% | median lead | "
              "false alarms | targets (AUROC >= 0.9, false alarms <= 5%) |", "|---|---|---|---|---|---|---|"]
    text = [
        "# Early warning", "",
        "Generated by `make warning-eval` (`python -m experiments.warning.evaluate`); do not edit. The detector is "
        "`strategies/watch/detector.py`; its coefficients `strategies/watch/fitted.py` (written by the same command).", "",
        "## Use", "",
        "```python",
        "from strategies.watch import Watch, hf_callback, lightning_callback",
        "watch = Watch(scaler, model, loss_fn=lambda m, b: loss_of(m, b))   # a plain loop:",
        "#   after scaler.unscale_(opt): watch.unscaled()   (optional: per-layer-group abs-max)",
        "#   after scaler.update():      watch.step(loss, lr, batch)",
        "trainer = lightning.Trainer(callbacks=[lightning_callback()],        # Lightning's MixedPrecision scaler",
        "                            plugins=[MixedPrecision('16-mixed', 'cuda', scaler=strategies.create('native'))])",
        "hf_trainer.add_callback(hf_callback(hf_trainer))                    # HF Trainer: accelerator.scaler",
        "```", "",
        "The first alarm logs one line (logger `scalelab.watch`) of the form `scalelab watch: step N: overflows: P% "
        "of the last 16 steps skipped; doctor says: forward overflow at <module>`: the doctor re-runs the alarm's "
        "batch; a forward heading for an overflow reads `forward activations at P% of the format's max (H binades of "
        "headroom) in <module>`, and as it comes before the fault the doctor then says `no fault in this step yet`. "
        "`Watch` hooks the model's leaf modules for the forward activation abs-max "
        "(`activations=False`: it does not; `watch.close()` takes the hooks off). `watch.replay(strategy)` is "
        "`scalelab-replay` on the run so far; `watch.save(path)` writes its `trace.jsonl`. The tests run all three with "
        "the real packages (`tests/strategies/test_watch.py`).", "",
        "## What it reads and how it decides", "",
        *_features(),
        "A logistic regression of the standardised features gives a score in [0, 1]; the run is flagged when the score "
        "reaches the threshold, chosen on the training runs so that at most 5% of the healthy ones would ever be "
        "flagged. The warning names the feature that pushed the score most (e.g. *scale heading for its floor*), and the "
        "callbacks then ask the doctor for the cause (`docs/doctor.md`).", "",
        *_model(results["model"]), "",
        "## How it was evaluated", "",
        f"Labelled runs (each `{' '.join(COMMON)}`, seeds {', '.join(map(str, SEEDS))}, the scaler "
        f"{' / '.join(STRATEGIES)} alternating with the seed but where a workload pins one): a workload that "
        "fails by construction and its healthy twin at a tenth of the learning rate, and a near-edge run at a third "
        "of it (below). A run's label is its outcome "
        "(`diverged`/`stalled`/`failed` = failed; a healthy twin or near-edge run that fails counts as failing).", "",
        *_data(results["runs"]), "",
        "`finetune_lr_spike` is the natural fine-tuning workload (`conf/workload/finetune.yaml`) with a learning-rate "
        "spike; `scale_floor` is `lr_spike` under `native` with a high floor that raises when reached (the scale "
        "pinned at its floor). Not included: the reinforcement-learning workload (`conf/workload/rl.yaml`) has no "
        "setting found that fails by construction (`experiments/warning/data.py` says what was tried).", "",
        "The horizon of a failing run is the number of steps it took to fail; a warning counts when it comes at the "
        "latest at 80% of it (a lead of at least 20% of the horizon). AUROC compares each failing run's highest score up "
        "to that point with each healthy run's highest score over the same number of steps; false alarms count healthy "
        "runs flagged anywhere in the whole run.", "",
        "## Results (held-out runs)", "", *_targets(results), "", *header,
        _row(f"seeds {', '.join(str(s) for s in sorted(set(SEEDS) - set(TRAIN_SEEDS)))} held out (fit on seeds "
             f"{', '.join(map(str, TRAIN_SEEDS))})", results["seeds"]),
        *(_row(f"workload `{w}` held out (and its seeds)", e) for w, e in results["workloads"].items()), "",
        "Reading:", "", *_reading(results), "",
        *_near(results),
        "For reference, on the training runs themselves:", "", *header, _row("training runs", results["train"]), "",
        f"Cost: {results['minutes']:.1f} min wall, {results.get('cpu_minutes', float('nan')):.1f} min of CPU for this "
        f"command ({results['trained']} of {len(results['runs'])} labelled runs trained in it, any others reused from an "
        "earlier one; one CPU thread)" + _data_cost(results) + ".", "",
    ]
    return "\n".join(text)
