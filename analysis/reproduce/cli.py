"""``scalelab-reproduce`` (``make reproduce``): train every published claim's sweeps, then write
``docs/reproductions.md`` (issue 22).

For each claim of :data:`analysis.reproduce.claims.CLAIMS` (or those of ``--claims``) and each entry of its
``Claim.sweeps``, one ``scalelab-train`` multirun as a subprocess (:func:`sweep_args`)::

    scalelab-train -m +experiment=<claim.experiment> hydra.sweep.dir=<out>/<name> <sweep> [<claim.quick> | <claim.long>]

with ``OMP_NUM_THREADS=1`` and ``WANDB_MODE`` offline unless set (:func:`train_env`). The sweep
prints its own progress lines (:class:`experiments.app.progress.SweepProgress`, as ``make compare``);
the runner adds one header line per claim and a closing line. A sweep that exits non-zero is
reported and the other claims still run; the page says so. Re-running resumes: a run directory
that holds a finished run returns at once (:meth:`experiments.app.rundir.RunDir.resume_plan`), so
only missing or unfinished runs train. ``--report-only`` rebuilds the page from ``<out>`` alone
(:mod:`analysis.reproduce.page`), byte-identical when the runs are unchanged. ``--long`` trains
only the claims that declare ``Claim.long`` (a horizon where their mechanism acts) into
``runs/reproduce_long`` and writes ``docs/reproductions-long.md`` beside the standard horizon's
verdicts (:mod:`analysis.reproduce.horizon`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import analysis.reproduce.claims as registry
from analysis.reproduce.claims.base import Claim
from analysis.reproduce.horizon import write_horizon_page
from analysis.reproduce.page import record_start, record_sweep, train_args, write_page
from analysis.text import clock
from analysis.words import VERDICTS

__all__ = ["DEFAULTS", "main", "run_claims", "select_claims", "sweep_args", "train_env"]

#: (runs folder, page) by mode: a quick pass never overwrites the committed page.
DEFAULTS = {False: ("runs/reproduce", "docs/reproductions.md"),
            True: ("runs/reproduce_quick", "reports/reproduce_quick/reproductions.md"),
            "long": ("runs/reproduce_long", "docs/reproductions-long.md")}
TRAIN = (sys.executable, "-m", "experiments.app.train")
"""How a sweep is started: the training app of this interpreter (the same code as ``scalelab-train``)."""


def say(text: str) -> None:
    print(f"scalelab-reproduce: {text}", file=sys.stderr, flush=True)


def select_claims(names: str | None, claims: Sequence[Claim]) -> list[Claim]:
    """The claims named in ``names`` (comma-separated), in registry order; all when ``None``.
    An unknown name is a one-line ``ValueError`` listing the known ones."""
    if names is None:
        return list(claims)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [c.name for c in claims]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        what = f"unknown claim {unknown[0]!r}" if unknown else "--claims names no claim"
        raise ValueError(f"{what}; known claims: {', '.join(known) if known else 'none registered'}")
    return [c for c in claims if c.name in wanted]


def sweep_args(claim: Claim, out: str | Path, quick: bool, long: bool = False) -> list[list[str]]:
    """The ``scalelab-train`` arguments of every sweep of ``claim`` (one list per ``Claim.sweeps``
    entry; under ``long``, per ``Claim.long_sweeps`` entry where the claim names them)."""
    sweeps = claim.long_sweeps if long and claim.long_sweeps else claim.sweeps
    return [train_args(claim, out, sweep, quick, long) for sweep in sweeps]


def train_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``OMP_NUM_THREADS=1`` (the launcher's workers share the cores) and
    ``WANDB_MODE`` defaulting to ``offline`` (as ``make compare``)."""
    env = dict(base)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("WANDB_MODE", "offline")
    return env


def run_claims(claims: Sequence[Claim], out: str, quick: bool, command: str,
               train: Sequence[str] = TRAIN, long: bool = False) -> int:
    """Run every sweep of ``claims`` one after another (see the module docstring); return how
    many sweeps failed. Each finished sweep is noted in ``<out>/reproduce.json``."""
    record_start(out, command, quick, [c.name for c in claims], long)
    env = train_env(os.environ)
    failed = 0
    for k, claim in enumerate(claims, start=1):
        sweeps = sweep_args(claim, out, quick, long)
        say(f"[claim {k}/{len(claims)}] {claim.name}: {claim.title} -- {len(sweeps)} sweep(s) "
            f"of +experiment={claim.experiment} into {Path(out) / claim.name}")
        for args in sweeps:
            shown = shlex.join(["scalelab-train", *args])
            try:
                rc = subprocess.run([*train, *args], env=env, check=False).returncode
            except OSError as exc:
                say(f"cannot start {shown}: {exc}")
                rc = 127
            record_sweep(out, claim.name, shown, rc, quick)
            if rc != 0:
                failed += 1
                say(f"{claim.name}: sweep exited with status {rc} ({shown}); going on with the next")
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``scalelab-reproduce``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="scalelab-reproduce",
        description="Train the sweeps of every published claim (analysis/reproduce/claims/) and write the "
                    "reproduction page. Re-running resumes: finished runs are not trained again.")
    parser.add_argument("--quick", action="store_true", help="the quick subset of each claim "
                        "(its Claim.quick overrides; default --out and --doc change with it)")
    parser.add_argument("--long", action="store_true", help="the claims with a mechanism that acts over "
                        "steps, at a horizon where it acts (their Claim.long overrides); writes "
                        "docs/reproductions-long.md beside the standard horizon's verdicts (--baseline)")
    parser.add_argument("--baseline", default=DEFAULTS[False][0],
                        help="--long: the standard horizon's runs folder (default runs/reproduce)")
    parser.add_argument("--claims", metavar="NAME[,NAME]", default=None,
                        help="train only these claims (default: all); the page covers all")
    parser.add_argument("--out", default=None, help="runs folder (default runs/reproduce; "
                        "quick: runs/reproduce_quick; long: runs/reproduce_long)")
    parser.add_argument("--doc", default=None, help="page (default docs/reproductions.md; "
                        "quick: reports/reproduce_quick/reproductions.md; long: docs/reproductions-long.md)")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the page from the runs under --out; train nothing")
    args = parser.parse_args(argv)
    if args.long and args.quick:
        parser.error("--long and --quick are two different horizons: choose one")
    every = list(registry.CLAIMS)
    try:
        chosen = select_claims(args.claims, every)
    except ValueError as exc:
        print(f"scalelab-reproduce: error: {exc}", file=sys.stderr)
        return 2
    mode = "long" if args.long else args.quick
    if args.long:
        chosen = [c for c in chosen if c.long]
    out = args.out or DEFAULTS[mode][0]
    doc = args.doc or DEFAULTS[mode][1]
    start = time.monotonic()
    failed = 0
    if not args.report_only:
        command = shlex.join(["scalelab-reproduce", *argv])
        try:
            failed = run_claims(chosen, out, args.quick, command, long=args.long)
        except KeyboardInterrupt:
            say(f"interrupted after {clock(time.monotonic() - start)}; the same command resumes "
                "(finished runs are kept), --report-only writes the page from what ran")
            return 130
    results = (write_horizon_page(out, doc, every, args.baseline) if args.long
               else write_page(out, doc, every, args.quick))
    verdicts = [f.verdict for r in results for f in r.findings]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS)
    missing = [r.claim.name for r in results if r.problem]
    ran = "" if args.report_only else f"{len(chosen)} claim(s) run, {failed} sweep(s) failed, "
    say(f"{ran}findings: {counts}" + (f"; no findings for {', '.join(missing)}" if missing else "")
        + f" | {clock(time.monotonic() - start)}")
    print(doc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
