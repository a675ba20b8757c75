"""The metrics a comparison reads, each named once: column, label, unit, how sentences count it.

Every table header, figure axis and title, verdict sentence and page of :mod:`analysis` that
names a metric takes the name from its :class:`Metric` here (``tests/analysis/test_house.py``
fails when a label or noun is written as a string anywhere else in ``analysis/``).

**Direction**: lower is better for every metric (a paired difference ``strategy − baseline``
below 0 favours the strategy; the ranking sorts ascending); a metric where higher is better
enters as its complement (``fidelity_one_minus_cos_mean``, not the cosine).

**Unit**: ``"fraction"`` is shown as a percentage (:func:`analysis.text.pct`), anything else as
a number (:func:`analysis.text.fmt`) with the unit, where there is one, beside the label.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACT_ZERO_FRAC", "FINAL_EVAL_LOSS", "FINAL_PRIMARY", "FINAL_REWARD", "LOST_ENTRIES", "METRICS", "METRIC_BY_COLUMN",
           "Metric", "ONE_MINUS_COS", "PRIMARY", "SKIPPED_STEPS", "STEPS_TO_TARGET",
           "STRATEGY_OVERHEAD", "label", "metric", "primary_name"]


@dataclass(frozen=True)
class Metric:
    """A per-run metric compared across strategies (lower is better).

    ``column`` of the ``runs`` table; ``label`` (tables, axes, the verdict's metric order);
    ``description`` (the report's Method); ``unit`` (``"fraction"``, ``"steps"``, ``"nats"`` or
    ``""`` for a count);
    ``noun``: the words a sentence counts it in ("3 skipped steps per run"), the label unless
    given. ``diverged_loses``: a diverged run counts as ``+inf`` in the rank statistics and the
    pairing; ``inf_loses``: a completed run's ``+inf`` value (never reached) counts the same way.
    Both are left out of means either way. ``timing``: a wall-clock measurement, which machine
    load moves between runs of the same code: it is shown but never read as a difference
    (:data:`analysis.words.TIMING`), never decides a verdict and never names a winner (issue 30;
    speed is measured side by side by ``scalelab-bench``).
    ``negligible``: the smallest paired difference worth naming, in the metric's unit; a
    comparison whose whole interval lies inside ``±negligible`` reads
    :data:`analysis.words.NEGLIGIBLE` and never names a winner (0: every detected difference is
    named). Runs are deterministic per seed, so a difference far below anything that matters
    can still be statistically certain."""

    column: str
    label: str
    description: str
    unit: str = ""
    noun: str = ""
    diverged_loses: bool = False
    inf_loses: bool = False
    timing: bool = False
    negligible: float = 0.0

    def __post_init__(self) -> None:
        if not self.noun:
            object.__setattr__(self, "noun", self.label)

    @property
    def pct(self) -> bool:
        """Whether values are fractions, shown as percentages."""
        return self.unit == "fraction"


FINAL_EVAL_LOSS = Metric(
    "final_eval_loss", "final eval loss",
    "validation loss at the end of training (primary metric)", unit="nats", diverged_loses=True)
FINAL_REWARD = Metric(
    "final_reward", "final reward",
    "rl: mean reward of one completion per fixed evaluation prompt at the end of training (higher "
    "is better: the report ranks by its negation, the court by the reward itself)")
FINAL_PRIMARY = Metric(
    "final_primary", "primary metric",
    "each workload's own primary metric at the end of training, as the workload declares it "
    "(summary.json `primary`, conf/workload/*.yaml `regime.primary`): the final eval loss (nats), "
    "or on `rl` minus the final reward, so that lower is better in every column and a higher "
    "reward ranks first; a difference under 1e-4 (nats, or reward on a 0-1 scale) is negligible",
    diverged_loses=True, negligible=1e-4)
STEPS_TO_TARGET = Metric(
    "steps_to_target", "time to target",
    "first logged step whose training loss (loss_avg) is at or below the target: the fp32 "
    "run's (same workload and seed) at its first logged step ≥ half its steps; never "
    "reached = inf (loses its seed, left out of means)", unit="steps", diverged_loses=True,
    inf_loses=True)
SKIPPED_STEPS = Metric(
    "skipped_steps", "skipped steps",
    "optimizer steps skipped because of non-finite gradients")
STRATEGY_OVERHEAD = Metric(
    "strategy_overhead_frac", "strategy overhead",
    "mean per-step time in the strategy's scale/unscale/update, as a fraction of the step "
    "(wall clock: shown, never read as a difference)", unit="fraction", timing=True)
ACT_ZERO_FRAC = Metric(
    "act_zero_frac_mean", "act-grad zero fraction",
    "fraction of activation-gradient elements that are exactly zero (underflow plus "
    "structural zeros such as ReLU), averaged over layers and logged steps; a difference under "
    "0.01 percentage points is negligible", unit="fraction", noun="activation-gradient zeros", negligible=1e-4)
LOST_ENTRIES = Metric(
    "fidelity_lost_frac_mean", "lost gradient entries",
    "fraction of gradient entries nonzero in fp32 but zero in mixed precision, mean over the "
    "fidelity probes (train.fidelity_every); a difference under 0.01 percentage points is negligible",
    unit="fraction", negligible=1e-4)
ONE_MINUS_COS = Metric(
    "fidelity_one_minus_cos_mean", "1 - cosine to fp32",
    "1 - cosine similarity of the unscaled mixed-precision gradient and the fp32 gradient, mean "
    "over the fidelity probes; a difference under 1e-6 is negligible (fp16's rounding alone, unit "
    "roundoff u = 2^-11 with errors uniform in ±u, gives 1 - cos ≈ u²/6 ≈ 4e-8)", negligible=1e-6)

#: The metrics the report compares, primary first.
METRICS: tuple[Metric, ...] = (FINAL_PRIMARY, STEPS_TO_TARGET, SKIPPED_STEPS, STRATEGY_OVERHEAD,
                               ACT_ZERO_FRAC, LOST_ENTRIES, ONE_MINUS_COS)
PRIMARY = FINAL_PRIMARY.column
METRIC_BY_COLUMN = {m.column: m for m in (*METRICS, FINAL_EVAL_LOSS, FINAL_REWARD)}


def metric(column: str) -> Metric:
    """The :class:`Metric` of ``column``; an unknown column is its own label and description."""
    return METRIC_BY_COLUMN.get(column, Metric(column, column, column))


def label(column: str) -> str:
    """The label of ``column`` (itself when it is not a metric's)."""
    return metric(column).label


def primary_name(column: str, higher: bool) -> str:
    """How a table names a workload's primary metric ``column`` in the report's lower-is-better
    :data:`FINAL_PRIMARY` column: its label, ``−`` before it where higher is better."""
    return ("−" if higher else "") + label(column)
