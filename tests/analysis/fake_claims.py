"""Made-up claims over the synthetic sweeps of ``tests/analysis/synth.py``, for the tests of the
reproduction runner and page (``analysis/reproduce/cli.py``, ``analysis/reproduce/page.py``).

``GOOD`` compares synthetic strategies whose true final eval losses are known (max_ema 0.50 <
native 0.70, sd 0.01), so its direction finding is *reproduced* and its parity one (max_ema vs
native within ±0.01) *not reproduced*; ``BROKEN``'s ``evaluate`` raises; ``ABSENT`` never has runs.
"""

from __future__ import annotations

from pathlib import Path

from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, direction, paired_values, parity
from tests.analysis.synth import SweepSpec, write_sweep

SEEDS = 12


def evaluate_good(runs: ClaimRuns) -> list[Finding]:
    a, b = paired_values(runs.runs, {"strategy": "max_ema"}, {"strategy": "native"})
    return [
        direction("final eval loss, max_ema minus native", "max_ema lower (made up)", a, b, "lower",
                  note="synthetic | made up"),
        parity("final eval loss, max_ema minus native", "parity (made up)", a, b, margin=0.01),
    ]


def evaluate_broken(runs: ClaimRuns) -> list[Finding]:
    raise RuntimeError("evaluate blew up\non two lines")


def _claim(name: str, evaluate, **kw) -> Claim:
    return Claim(name=name, title=f"the {name} claim", source=f"Nobody et al., {name} (2099)",
                 claim=f"{name} says something", deviations=(f"{name} deviation one", "deviation two"),
                 evaluate=evaluate, **kw)


GOOD = _claim("good", evaluate_good, sweeps=(("precision=fp16", "strategy=max_ema,native"),
                                             ("precision=fp32", "strategy=none")),
              quick=("seed=0,1", "train.steps=4"))
BROKEN = _claim("broken", evaluate_broken)
ABSENT = _claim("absent", evaluate_good)
FAKE_CLAIMS = [GOOD, BROKEN, ABSENT]


def write_fake_runs(out: Path) -> None:
    """Synthetic sweeps for ``GOOD`` and ``BROKEN`` under ``out`` (none for ``ABSENT``)."""
    for claim in (GOOD, BROKEN):
        write_sweep(out / claim.name, SweepSpec(seeds=SEEDS))
