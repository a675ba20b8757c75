"""The words of every verdict :mod:`analysis` writes, defined once.

* **Paired readings** of one strategy against a baseline, seed by seed (the rule:
  :func:`analysis.paired.reading`; the report, ``comparisons.csv``, ``which_strategy_when.csv``);
  :data:`PHRASES` puts each in a sentence against a named baseline
  (:func:`analysis.verdict.phrase`);
  a wall-clock metric (``Metric.timing``) is never read: its reading is :data:`TIMING`.
* **An exact tie** for the best strategy (:data:`TIE`): two strategies with the same paired
  effect are both named, never the first in some order.
* **Across workloads**: a strategy's AlgoPerf score B against ``native``'s
  (:func:`analysis.when.cross_workload_table`; ``cross_workload.csv``).
* **Reproduced claims**: the verdict of one finding (:mod:`analysis.reproduce.claims.base`), and
  the verdict-column words of a claim with no findings (:mod:`analysis.reproduce.page`).

Everything else imports them (``tests/analysis/test_house.py`` fails when one of the readings,
the words across workloads or the claim verdicts is written as a string anywhere else in
``analysis/``).
"""

from __future__ import annotations

__all__ = ["ACROSS", "BETTER_ACROSS", "BETTER_FEW", "CLEARLY_BETTER", "CLEARLY_WORSE",
           "EVAL_ERROR", "INCONCLUSIVE", "NOT_COMPARABLE", "NOT_REPRODUCED", "NOT_RUN",
           "NEGLIGIBLE", "NO_DIFFERENCE", "PHRASES", "READINGS", "REPRODUCED", "TIE", "TIE_ACROSS", "TIMING",
           "TOO_FEW", "VERDICTS", "WORSE_ACROSS", "WORSE_FEW"]

# -- paired readings (analysis/paired.py) --------------------------------------------------------
CLEARLY_BETTER, CLEARLY_WORSE = "clearly better", "clearly worse"
TOO_FEW = "too few seeds"
BETTER_FEW = f"better in these seeds, but {TOO_FEW}"
WORSE_FEW = f"worse in these seeds, but {TOO_FEW}"
NO_DIFFERENCE = "no detectable difference"
NEGLIGIBLE = "negligible difference"
NOT_COMPARABLE = "not comparable"
TIMING = "not read: wall-clock time moves with machine load"
READINGS = (CLEARLY_BETTER, CLEARLY_WORSE, BETTER_FEW, WORSE_FEW, NO_DIFFERENCE, NEGLIGIBLE,
            NOT_COMPARABLE, TIMING)
TIE = "tie"

#: The sentence of each reading against a baseline ``{b}`` (the report's verdict).
PHRASES = {
    CLEARLY_BETTER: f"{CLEARLY_BETTER} than {{b}}",
    CLEARLY_WORSE: f"{CLEARLY_WORSE} than {{b}}",
    BETTER_FEW: f"better than {{b}} in these seeds, but {TOO_FEW} for a significant test",
    WORSE_FEW: f"worse than {{b}} in these seeds, but {TOO_FEW} for a significant test",
    NO_DIFFERENCE: f"{NO_DIFFERENCE} from {{b}}",
    NEGLIGIBLE: f"only a {NEGLIGIBLE} from {{b}} (below the metric's smallest effect worth naming)",
    NOT_COMPARABLE: f"{NOT_COMPARABLE} (too few finished runs)",
    TIMING: f"{TIMING} (speed: scalelab-bench)",
}

# -- across workloads (analysis/when.py) ---------------------------------------------------------
BETTER_ACROSS, WORSE_ACROSS, TIE_ACROSS = ("higher B than `native`", "lower B than `native`",
                                           "tie: the interval of B − B_native includes 0")
ACROSS = (BETTER_ACROSS, WORSE_ACROSS, TIE_ACROSS)

# -- reproduced claims (analysis/reproduce/) -----------------------------------------------------
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE)
#: Verdict-column words of a claim that has no findings (besides the three verdicts).
NOT_RUN, EVAL_ERROR = "not run", "error"
