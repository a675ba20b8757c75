"""``docs/reproductions.md``: the page of every published claim scalelab re-tests (issue 22).

The runner (``scalelab-reproduce``, :mod:`analysis.reproduce.cli`) trains each claim's sweeps into
``<out>/<claim name>`` and notes what it ran in ``<out>/reproduce.json`` (:data:`RECORD_NAME`: the
runner's command line, quick or full, and per claim each sweep's command and exit status). This
module turns ``<out>`` into the page, and nothing else: no date and no clock, so a page rebuilt
from the same runs is byte-identical (``scalelab-reproduce --report-only``).

The page holds a title and provenance (the command, quick or full, the git commit(s) the runs
record in their ``fingerprint.git_sha``), one summary table over every claim of
:data:`analysis.reproduce.claims.CLAIMS` (one row per :class:`~analysis.reproduce.claims.base.Finding`: measure,
the source's number, scalelab's estimate with its 95 % interval, paired seeds, verdict), then one
section per claim (source, claim, deviations of the small setting, findings with notes, run counts
by status, the sweeps run and how to run them larger). A claim without runs, or whose
``evaluate`` raises, gets one row saying so in one line; the rest of the page is still written.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from analysis.document import Document, write_document
from analysis.load import RunLoadError
from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, load_claim_runs
from analysis.text import code, fmt, write_atomic
from analysis.words import EVAL_ERROR, INCONCLUSIVE, NOT_REPRODUCED, NOT_RUN, REPRODUCED

__all__ = ["ClaimResult", "RECORD_NAME", "build_page", "evaluate_claim", "fmt_estimate",
           "larger_command", "read_record", "made_by", "record_start", "record_sweep", "runners", "runs_line", "train_args",
           "write_page"]

RECORD_NAME = "reproduce.json"
#: Failure statuses of a run (analysis/records.py) that make a claim's runs incomplete.
_BAD_STATUSES = ("failed", "incomplete", "unknown")
_MAX_WHY = 200


# -- the runner's record ------------------------------------------------------------------------
def read_record(out: str | Path) -> dict[str, Any]:
    """``<out>/reproduce.json``; ``{}`` when missing or unreadable (the page then says less)."""
    try:
        data = json.loads((Path(out) / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(out: str | Path, record: dict[str, Any]) -> None:
    write_atomic(Path(out) / RECORD_NAME, json.dumps(record, indent=1, sort_keys=True) + "\n")


def record_start(out: str | Path, command: str, quick: bool, claims: Sequence[str], long: bool = False) -> None:
    """Note the runner's ``command`` and mode, and that command as the ``runner`` of each of the
    ``claims`` it will run (their earlier sweeps forgotten); the claims run by an earlier command
    keep their sweeps and their runner."""
    record = read_record(out)
    runs = record.get("claims") if isinstance(record.get("claims"), dict) else {}
    kept = {k: v for k, v in runs.items() if k not in claims}
    record = {"command": command, "quick": bool(quick),
              "claims": {**kept, **{k: {"quick": bool(quick), "sweeps": [], "runner": command} for k in claims}}}
    if long:
        record["long"] = True
    _write_record(out, record)


def runners(record: dict[str, Any], claims: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The runner commands that made the runs of ``claims``, in order of first appearance, each with
    its claims: a claim's recorded ``runner``, else (a record written before runners were kept) the
    record's last ``command``. Claims the record has no entry for (never run) are left out; if that
    leaves none, the last command stands for all."""
    runs = record.get("claims") if isinstance(record.get("claims"), dict) else {}
    last = record.get("command") or "scalelab-reproduce"
    out: dict[str, list[str]] = {}
    for name in claims:
        entry = runs.get(name)
        if isinstance(entry, dict):
            runner = entry.get("runner") if isinstance(entry.get("runner"), str) else last
            out.setdefault(runner, []).append(name)
    return list(out.items()) or [(last, list(claims))]


def made_by(record: dict[str, Any], claims: Sequence[str], default: str) -> str:
    """The :func:`runners` of ``claims`` as page text: ``cmd`` for one, ``cmd1 (a, b) and cmd2 (c)``
    for several (``default`` when the record names none)."""
    found = runners(record, claims) if record else []
    if len(found) <= 1:
        return code(found[0][0] if found else default)
    return " and ".join(f"{code(cmd)} ({', '.join(names)})" for cmd, names in found)


def record_sweep(out: str | Path, claim: str, command: str, rc: int, quick: bool) -> None:
    """Append one finished sweep (its ``scalelab-train`` command and exit status) to ``claim``'s."""
    record = read_record(out)
    runs = record.setdefault("claims", {})
    entry = runs.setdefault(claim, {"quick": bool(quick), "sweeps": []})
    entry["sweeps"].append({"command": command, "rc": int(rc)})
    _write_record(out, record)


# -- commands ------------------------------------------------------------------------------------
def train_args(claim: Claim, out: str | Path, sweep: Sequence[str], quick: bool, long: bool = False) -> list[str]:
    """The ``scalelab-train`` arguments of one sweep of ``claim``: multirun of its experiment into
    ``<out>/<name>``, then the sweep's overrides, then ``claim.quick`` under ``--quick`` or
    ``claim.long`` under ``--long`` (a later override of a key wins, so they may cut or stretch
    what the sweep set)."""
    return ["-m", f"+experiment={claim.experiment}", f"hydra.sweep.dir={Path(out) / claim.name}",
            *sweep, *(claim.quick if quick else ()), *(claim.long if long else ())]


def larger_command(claim: Claim, sweep: Sequence[str]) -> str:
    """The command a GPU user starts from to run one sweep of ``claim`` larger."""
    return shlex.join(["scalelab-train", "-m", f"+experiment={claim.experiment}", *sweep,
                       "device=cuda", "train.steps=..."])


# -- one claim -----------------------------------------------------------------------------------
@dataclass
class ClaimResult:
    """What the page says of one claim: its ``findings``, or ``problem`` (one line: why none);
    run counts by ``statuses``; the ``sweeps`` the runner recorded (command, exit status);
    the ``git_shas`` its runs recorded."""

    claim: Claim
    findings: list[Finding] = field(default_factory=list)
    problem: str = ""
    verdict: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    sweeps: list[dict[str, Any]] = field(default_factory=list)
    git_shas: list[str] = field(default_factory=list)

    @property
    def failed_sweeps(self) -> list[dict[str, Any]]:
        return [s for s in self.sweeps if s.get("rc") != 0]

    @property
    def bad_runs(self) -> int:
        return sum(self.statuses.get(s, 0) for s in _BAD_STATUSES)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}"[:_MAX_WHY]


def evaluate_claim(claim: Claim, out: str | Path, record: dict[str, Any] | None = None) -> ClaimResult:
    """Load ``<out>/<claim.name>`` and evaluate it; never raises for the claim's own failures."""
    record = read_record(out) if record is None else record
    entry = (record.get("claims") or {}).get(claim.name) or {}
    sweeps = [s for s in entry.get("sweeps", []) if isinstance(s, dict)]
    result = ClaimResult(claim, sweeps=sweeps)
    try:
        runs: ClaimRuns = load_claim_runs(Path(out) / claim.name, claim.factors)
    except RunLoadError as exc:
        result.problem, result.verdict = f"no runs ({' '.join(str(exc).split())[:_MAX_WHY]})", NOT_RUN
        return result
    frame = runs.runs
    result.statuses = {str(k): int(v) for k, v in sorted(frame["status"].value_counts().items())}
    result.git_shas = sorted({s for s in frame["git_sha"] if isinstance(s, str) and s})
    try:
        findings = list(claim.evaluate(runs))
        if not all(isinstance(f, Finding) for f in findings):
            raise TypeError("evaluate must return a list of Finding")
    except Exception as exc:  # noqa: BLE001 - one claim's bug must not cost the page
        result.problem, result.verdict = f"evaluate failed: {_one_line(exc)}", EVAL_ERROR
        return result
    if not findings:
        result.problem, result.verdict = "evaluate returned no findings", EVAL_ERROR
    result.findings = findings
    return result


# -- the page ------------------------------------------------------------------------------------
def fmt_estimate(f: Finding) -> str:
    """``estimate [lo, hi]`` with 3 significant digits, more (up to 6) when fewer would print two
    different ones of the three alike; ``–`` when there is no estimate."""
    if not math.isfinite(f.estimate):
        return "–"
    if not (math.isfinite(f.lo) and math.isfinite(f.hi)):
        return f"{fmt(f.estimate)} [no interval]"
    values, digits = {f.estimate, f.lo, f.hi}, 3
    while digits < 6 and len({fmt(v, digits) for v in values}) < len(values):
        digits += 1
    return f"{fmt(f.estimate, digits)} [{fmt(f.lo, digits)}, {fmt(f.hi, digits)}]"


def _claim_cell(r: ClaimResult) -> str:
    notes = []
    if r.failed_sweeps:
        notes.append(f"{len(r.failed_sweeps)} sweep(s) failed")
    if r.bad_runs:
        notes.append(f"{r.bad_runs} run(s) failed or unfinished")
    return f"{r.claim.name}" + (f" ({'; '.join(notes)})" if notes else "")


def _summary_rows(results: Sequence[ClaimResult]) -> list[list[str]]:
    rows = []
    for r in results:
        for f in r.findings:
            rows.append([_claim_cell(r), f.measure, f.paper, fmt_estimate(f), str(f.n), f.verdict])
        if r.problem:
            rows.append([_claim_cell(r), "–", "–", r.problem, "–", r.verdict])
    return rows


def runs_line(r: ClaimResult, out: str) -> str:
    """``**Runs:** N under <out>/<claim> (counts by status); experiment <name>.`` (or none)."""
    where = code(f"{out}/{r.claim.name}")
    if not r.statuses:
        return f"**Runs:** none under {where}."
    total = sum(r.statuses.values())
    counts = ", ".join(f"{n} {status}" for status, n in r.statuses.items())
    return f"**Runs:** {total} under {where} ({counts}); experiment {code(r.claim.experiment)}."


def _section(doc: Document, k: int, r: ClaimResult, out: str) -> None:
    c = r.claim
    doc.h(1, f"{k}. {c.name}: {c.title}")
    doc.p(f"**Source.** {c.source}")
    doc.p(f"**Claim.** {c.claim}")
    if c.deviations:
        doc.p("**Deviations of the small setting from the source's:**")
        doc.bullets(list(c.deviations))
    if r.findings:
        doc.table(["measure", "source", "scalelab [95 % interval]", "n", "verdict", "note"],
                  [[f.measure, f.paper, fmt_estimate(f), str(f.n), f.verdict, f.note or "–"]
                   for f in r.findings], caption="**Findings.**")
    if r.problem:
        doc.p(f"**{r.verdict.capitalize()}:** {r.problem}")
    doc.p(runs_line(r, out))
    if r.sweeps:
        doc.p("**Sweeps run:**")
        doc.bullets([f"{code(s.get('command', '?'), 400)}: exit {s.get('rc', '?')}"
                     + ("" if s.get("rc") == 0 else " (a job failed or the sweep stopped)")
                     for s in r.sweeps])
    doc.p("**Run it larger** (any `model=`, `model.*`, `train.*` override; one line per sweep):")
    doc.bullets([code(larger_command(c, sweep), 400) for sweep in c.sweeps])


def build_page(results: Sequence[ClaimResult], record: dict[str, Any], out: str, quick: bool
               ) -> Document:
    """The page (see the module docstring); a pure function of its arguments."""
    quick = bool(record.get("quick", quick))
    command = made_by(record, [r.claim.name for r in results], "scalelab-reproduce" + (" --quick" if quick else ""))
    shas = sorted({s[:12] for r in results for s in r.git_shas})
    doc = Document("Reproduced claims")
    doc.p("Generated by `scalelab-reproduce` (`make reproduce`) from its runs; do not edit by hand. "
          "Each claim is a Hydra experiment (`conf/experiment/repro_<name>.yaml`) and a module of "
          "`analysis/reproduce/claims/` that states the source, the small setting's deviations from it, "
          "and how its findings are judged.")
    mode = ("the **quick** subset: fewer arms, steps or seeds than the full setting, and a finding "
            f"with fewer than 10 paired seeds reads {INCONCLUSIVE}" if quick
            else "the **full** setting")
    commits = (f"The runs were trained at git {', '.join(code(s) for s in shas)}." if shas
               else "No run records a git commit.")
    doc.p(f"Made by {command} from the runs under {code(out)}: {mode}. {commits} The same "
          "command with `--report-only` rebuilds this page from the same runs, byte for byte.")
    doc.p(f"Verdicts (`analysis/reproduce/claims/base.py`): **{REPRODUCED}** — the 95 % interval "
          "over paired seeds lies on the source's side (a difference excludes 0, a parity lies "
          "within its stated margin, a rate clears its threshold); "
          f"**{NOT_REPRODUCED}** — it lies on the other side; **{INCONCLUSIVE}** — neither, or "
          "fewer than 10 paired seeds.")
    doc.h(1, "Summary")
    if results:
        doc.table(["claim", "measure", "source", "scalelab [95 % interval]", "n", "verdict"],
                  _summary_rows(results))
    else:
        doc.p("No claims are registered (`analysis/reproduce/claims/__init__.py`: `CLAIMS`).")
    for k, r in enumerate(results, start=1):
        _section(doc, k, r, out)
    return doc


def write_page(out: str | Path, doc_path: str | Path, claims: Sequence[Claim], quick: bool) -> list[ClaimResult]:
    """Evaluate every claim in ``claims`` from ``<out>`` and write the page to ``doc_path``
    (:func:`analysis.document.write_document`); return the results (for the runner's closing
    line)."""
    record = read_record(out)
    results = [evaluate_claim(c, out, record) for c in claims]
    write_document(build_page(results, record, str(out), quick), doc_path)
    return results
