"""``scalelab-replay RUN_DIR --strategy NAME [--set key=value ...] [--json]``: what a strategy
would have done on a recorded run (``strategies.replay`` on the run's ``trace.jsonl``; RUN_DIR may
also be a trace file, such as ``strategies.watch.Watch.save`` writes from any training loop).

NAME is any option of ``conf/strategy/`` (a rule or a preset, resolved through its YAML as the app
does, with the run's precision) or a registered rule; ``--set`` overrides its options. Text output
(default): the recorded run in one line, the early warning on it (the first step the fitted detector,
``docs/early-warning.md``, would have fired at, and why), then per strategy the skipped steps, the scale's path, its
lowest point, its floor, the activation-gradient entries it would lose and how the trace's gaps are
bridged. ``--json``: one object per step (``step``, ``scale``, ``skipped``, ``scales`` for per-layer
rules, ``lost_frac``/``subnormal_frac`` at histogram steps). ``--strategy all``: every option, one
line each. ``--table``: ``replay.json`` into every failed or stalled run under RUN_DIR, every preset
replayed (``--presets a,b``: those only), for the report's replay table (:mod:`experiments.replay.table`).
``--overflow persist|bound``: the other overflow models (:mod:`strategies.tracing.inputs`).

Exit status: 0; 2 with one line on stderr for a missing or corrupt trace, an unknown strategy or a
bad ``--set``; 3 when the strategy reads what the trace does not record (said in one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.replay import presets, table
from experiments.replay.tracefile import ReplayError, load_trace
from strategies.tracing import Trace
from strategies.tracing.inputs import OVERFLOW_MODELS, MissingInput
from strategies.tracing.replay import ReplayResult, replay
from strategies.watch.detector import Detector, observations

__all__ = ["ReplayError", "load_trace", "main", "describe", "run", "warning_line"]


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _recorded(trace: Trace) -> str:
    m = trace.meta
    skipped = sum(trace.found_inf)
    return (f"recorded: {m.get('strategy', '?')}, {trace.format.name}, {m.get('workload', '?')}, seed {m.get('seed', '?')}: "
            f"{len(trace)} steps, {skipped} skipped, scale {_g(trace.scale[0][-1])} -> {_g(trace.scale[-1][-1])}")


def warning_line(trace: Trace) -> str:
    """The early warning (``strategies.watch.Detector``, the fitted one) on the recorded run: the
    first step it would have fired at, and why."""
    det = Detector()
    for obs in observations(trace):
        det.update(obs)
        if det.alarm_step is not None:
            return f"early warning: step {det.alarm_step} of {len(trace)}: {det.reason()}"
    return f"early warning: none in {len(trace)} steps"


def describe(name: str, result: ReplayResult) -> list[str]:
    """The text report of one replay."""
    s = result.summary()
    skipped = s["skipped_steps"]
    more = "" if s["skipped"] <= len(skipped) else f" (+{s['skipped'] - len(skipped)} more)"
    lines = [f"{name}: skips {s['skipped']} of {s['steps']} steps" + (f": {', '.join(map(str, skipped[:20]))}"
                                                                     f"{' ...' if len(skipped) > 20 else ''}{more}" if skipped else "")]
    steps = result.steps
    changes = [(b.step, a.scale, b.scale) for a, b in zip(steps, steps[1:]) if a.scale != b.scale]
    lines.append(f"  scale: {_g(steps[0].scale)} at step {steps[0].step} -> {_g(steps[-1].scale)} at step {steps[-1].step}; "
                 f"{len(changes)} changes" + (": " + ", ".join(f"{st}: {_g(b)}" for st, _, b in changes[:8]) +
                                              (" ..." if len(changes) > 8 else "") if changes else ""))
    lines.append(f"  lowest scale {_g(s['min_scale'])} first at step {s['min_scale_step']}; " +
                 (f"floor {_g(s['floor'])} " + (f"reached at step {s['floor_step']}" if s["floor_step"] else "never reached")
                  if s["floor"] is not None else "no floor (min_scale unset)"))
    hist = [x for x in steps if x.lost_frac is not None]
    if hist:
        worst = max(hist, key=lambda x: x.lost_frac)
        lines.append(f"  activation-gradient entries lost to underflow at {len(hist)} histogram steps: mean "
                     f"{100 * s['lost_frac_mean']:.3g}%, worst {100 * worst.lost_frac:.3g}% at step {worst.step}")
    if result.stopped:
        lines.append(f"  stops at step {result.stopped[0]}: {result.stopped[1]}")
    lines += [f"  note: {n}" for n in result.notes]
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scalelab-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--strategy", help="a conf/strategy option or registered rule; 'all': every option")
    p.add_argument("--table", action="store_true", help="write replay.json into every failed or stalled run under "
                   "RUN_DIR (every preset, or --presets), for the report's replay table")
    p.add_argument("--presets", default=None, metavar="A,B", help="with --table: these options only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a strategy option")
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.add_argument("--overflow", choices=OVERFLOW_MODELS, default="auto", help="overflow model of recorded overflows")
    return p


def _one(trace: Trace, name: str, sets: list[str], overflow: str) -> ReplayResult:
    strategy = presets.build(name, table.precision_of(trace), sets)
    return replay(trace, strategy, overflow=overflow)


def run(args: argparse.Namespace) -> int:
    if args.table:
        names = args.presets.split(",") if args.presets else None
        unknown = sorted(set(names or ()) - set(presets.options()))
        if unknown:
            raise ReplayError(f"--presets: unknown option {unknown[0]!r}; allowed: {', '.join(presets.options())}")
        written = table.write_tables(args.run_dir, names, args.overflow)
        print(f"scalelab-replay: {len(written)} failed or stalled runs under {args.run_dir}: replay.json written")
        return 0
    if not args.strategy:
        raise ReplayError("--strategy is required (a conf/strategy option, or 'all'), unless --table")
    trace = load_trace(args.run_dir)
    names = presets.options() if args.strategy == "all" else [args.strategy]
    if args.strategy == "all" and args.json:
        raise ReplayError("--json takes one strategy, not 'all'")
    if not args.json:
        print(_recorded(trace))
        print(warning_line(trace))
    code = 0
    for name in names:
        try:
            result = _one(trace, name, args.set, args.overflow)
        except MissingInput as exc:
            if len(names) == 1:
                print(f"scalelab-replay: cannot replay: {exc}", file=sys.stderr)
                return 3
            print(f"{name}: not replayed: {exc}")
            continue
        if args.json:
            for step in result.steps:
                print(json.dumps(step.as_dict()))
        else:
            print("\n".join(describe(name, result)))
    return code


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        code = run(args)
    except BrokenPipeError:  # a reader (head) that stopped reading
        code = 0
    except (ReplayError, presets.PresetError) as exc:
        print(f"scalelab-replay: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
