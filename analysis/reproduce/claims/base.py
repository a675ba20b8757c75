"""What every reproduced claim shares: its description (:class:`Claim`), one row of the
reproduction table (:class:`Finding`), the verdict rules, and the runs of its sweep as one frame.

A claim is one module of :mod:`analysis.reproduce.claims` holding ``CLAIM = Claim(...)`` (found
there by name, no list to edit). Its runs come from
``scalelab-train -m +experiment=repro_<name> hydra.sweep.dir=<out>/<name>`` (one such sweep per
entry of ``Claim.sweeps``), and ``Claim.evaluate`` turns them into findings: the source's number,
scalelab's estimate with its 95 % interval over paired seeds, and a verdict.

**Verdicts** (the words of ``docs/reproductions.md``, defined in :mod:`analysis.words`):

* :func:`direction` — the source says A is lower than B (or higher). Paired per-seed
  differences ``d = a - b``; their mean's BCa interval (:func:`analysis.stats.bootstrap_ci`)
  excludes 0 on the claimed side: **reproduced**; on the other side: **not reproduced**; else
  **inconclusive**.
* :func:`parity` — the source says A matches B. The interval of the mean difference lies inside
  ``±margin``: **reproduced**; it lies wholly outside: **not reproduced**; else
  **inconclusive**. The margin is the claim's, stated in its finding (equivalence needs one).
* :func:`share` — a rate (e.g. the share of seeds that diverged) with its Clopper–Pearson
  interval (:func:`analysis.stats.clopper_pearson`), compared with a threshold on the claimed side.

Fewer than :data:`MIN_PAIRS` paired seeds: **inconclusive** whatever the numbers say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import yaml

from analysis.load import MAX_OVERRIDES_BYTES, RecordError, load_runs, read_capped
from analysis.runset import RunSet
from analysis.stats import bootstrap_ci, clopper_pearson
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, VERDICTS

__all__ = ["Claim", "ClaimRuns", "Finding", "MIN_PAIRS", "direction", "load_claim_runs",
           "paired_values", "parity", "select_runs", "share"]

#: Paired seeds a verdict needs (issue 22: at least 10 per claim).
MIN_PAIRS = 10


@dataclass(frozen=True)
class Finding:
    """One row of the reproduction table.

    ``measure`` says what was compared and how (e.g. "final eval loss, fp16 S=8 minus fp32");
    ``paper`` is the source's number or statement as text; ``estimate`` with ``lo``/``hi`` is
    scalelab's (same units as ``measure``); ``n`` the paired seeds (or runs) behind it.
    """

    measure: str
    paper: str
    estimate: float
    lo: float
    hi: float
    n: int
    verdict: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass
class ClaimRuns:
    """The runs of one claim: ``runs`` is :attr:`RunSet.runs` with one column per
    ``Claim.factors`` path (read from each run's ``.hydra/config.yaml``); ``runset`` the whole
    :class:`RunSet` (per-step tables: ``train``, ``evals``, ``exp_hist``, ``layers`` ...)."""

    runs: pd.DataFrame
    runset: RunSet


@dataclass(frozen=True)
class Claim:
    """One published claim and how scalelab tests it.

    * ``name`` — ``<out>/<name>`` (runs) and, unless ``experiment`` says otherwise,
      ``conf/experiment/repro_<name>.yaml``;
    * ``title``, ``source`` (paper, venue, and repository path where a number comes from code),
      ``claim`` (what the source says, one or two sentences);
    * ``deviations`` — every way the small CPU setting differs from the paper's;
    * ``sweeps`` — one tuple of extra overrides per ``scalelab-train -m +experiment=repro_<name>``
      call (``((),)``: the experiment's own grid, once);
    * ``quick`` — overrides added to every sweep under ``--quick``;
    * ``long`` and ``horizon`` — overrides added to every sweep under ``--long`` (issue 30: a
      horizon at which the claim's mechanism acts, e.g. a 1024-step amax history filled or a
      2000-step growth interval reached) and one sentence saying what acts there; a claim
      without ``long`` has no such mechanism and ``--long`` leaves it out;
    * ``long_sweeps`` — the sweeps ``--long`` runs when not all of ``sweeps`` (e.g. one workload
      of two, where the other would cost hours of CPU); empty (the default): ``sweeps``;
    * ``factors`` — config paths (``optimizer.lr``, ``strategy.init_scale``, ``model.qk_norm``)
      that tell the arms apart beyond strategy/precision/workload; each becomes a column;
    * ``evaluate`` — :class:`ClaimRuns` to findings;
    * ``experiment`` — the Hydra experiment the sweeps run (``+experiment=<experiment>``);
      empty (the default) means ``repro_<name>``;
    * ``order`` — its place on ``docs/reproductions.md`` (and in
      :data:`analysis.reproduce.claims.CLAIMS`): claims sort by it, then by name.
    """

    name: str
    title: str
    source: str
    claim: str
    deviations: tuple[str, ...]
    evaluate: Callable[[ClaimRuns], list[Finding]]
    sweeps: tuple[tuple[str, ...], ...] = ((),)
    quick: tuple[str, ...] = ()
    long: tuple[str, ...] = ()
    horizon: str = ""
    long_sweeps: tuple[tuple[str, ...], ...] = ()
    factors: tuple[str, ...] = ()
    experiment: str = ""
    order: int = 0

    def __post_init__(self) -> None:
        if not self.experiment:
            object.__setattr__(self, "experiment", f"repro_{self.name}")
        if bool(self.long) != bool(self.horizon):
            raise ValueError(f"claim {self.name!r}: long and horizon go together (the overrides and what acts there)")
        if self.long_sweeps and not self.long:
            raise ValueError(f"claim {self.name!r}: long_sweeps needs long (the overrides that reach the horizon)")


def _dig(cfg: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(cfg, Mapping) or key not in cfg:
            return None
        cfg = cfg[key]
    return cfg


def _config(run_dir: str) -> Mapping[str, Any]:
    try:
        data = read_capped(Path(run_dir) / ".hydra" / "config.yaml", MAX_OVERRIDES_BYTES)
        cfg = yaml.safe_load(data.decode("utf-8", errors="replace"))
    except (OSError, RecordError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, Mapping) else {}


def load_claim_runs(sweep_dir: str | Path, factors: Sequence[str] = ()) -> ClaimRuns:
    """Every run under ``sweep_dir`` (:func:`analysis.load.load_runs`), with the ``factors``
    columns added (``None`` where a run's config lacks the path or cannot be read)."""
    runset = load_runs(str(sweep_dir))
    runs = runset.runs.copy()
    configs = [_config(d) for d in runs["run_dir"]]
    for path in factors:
        runs[path] = [_dig(c, path) for c in configs]
    return ClaimRuns(runs=runs, runset=runset)


def select_runs(runs: pd.DataFrame, where: Mapping[str, Any]) -> pd.DataFrame:
    """The rows of ``runs`` whose every ``where`` column equals its value."""
    mask = pd.Series(True, index=runs.index)
    for col, value in where.items():
        mask &= runs[col].map(lambda v, value=value: v == value)
    return runs[mask]


def paired_values(runs: pd.DataFrame, a: Mapping[str, Any], b: Mapping[str, Any],
                  metric: str = "final_eval_loss", diverged: float = math.inf
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``metric`` of the runs matching ``a`` and of those matching ``b`` (column -> value),
    aligned on the seeds both have. A diverged or stalled run counts as ``diverged`` (default
    ``+inf``); runs of other non-completed statuses leave their seed out."""
    def per_seed(where: Mapping[str, Any]) -> pd.Series:
        sel = select_runs(runs, where)
        vals = {}
        for _, r in sel.iterrows():
            if r["status"] == "completed" and r[metric] is not None and not pd.isna(r[metric]):
                vals[int(r["seed"])] = float(r[metric])
            elif r["status"] in ("diverged", "stalled"):
                vals[int(r["seed"])] = diverged
        return pd.Series(vals, dtype=float)
    x, y = per_seed(a), per_seed(b)
    seeds = sorted(set(x.index) & set(y.index))
    return x.loc[seeds].to_numpy(), y.loc[seeds].to_numpy()


def _mean_ci(d: np.ndarray) -> tuple[float, float, float]:
    d = d[np.isfinite(d)]
    if d.size == 0:
        return (math.nan, math.nan, math.nan)
    lo, hi = bootstrap_ci(d, "mean")
    return float(np.mean(d)), float(lo), float(hi)


def direction(measure: str, paper: str, a: np.ndarray, b: np.ndarray, claimed: str,
              note: str = "") -> Finding:
    """The source says ``a`` is ``claimed`` ("lower" or "higher") than ``b`` (paired arrays).
    Non-finite differences (a diverged side) are left out of the mean and said in the note."""
    if claimed not in ("lower", "higher"):
        raise ValueError(f"claimed must be 'lower' or 'higher', got {claimed!r}")
    with np.errstate(all="ignore"):
        d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    est, lo, hi = _mean_ci(d)
    n_inf = int(np.sum(~np.isfinite(d)))
    if n_inf:
        note = (note + "; " if note else "") + f"{n_inf} seed(s) with a diverged side left out of the mean"
    n = int(np.sum(np.isfinite(d)))
    sign = -1.0 if claimed == "lower" else 1.0
    if n < MIN_PAIRS or not (math.isfinite(lo) and math.isfinite(hi)):
        verdict = INCONCLUSIVE
    elif (hi < 0 if sign < 0 else lo > 0):
        verdict = REPRODUCED
    elif (lo > 0 if sign < 0 else hi < 0):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return Finding(measure, paper, est, lo, hi, n, verdict, note)


def parity(measure: str, paper: str, a: np.ndarray, b: np.ndarray, margin: float,
           note: str = "") -> Finding:
    """The source says ``a`` matches ``b``: equivalence within ``±margin`` (stated in the note)."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    with np.errstate(all="ignore"):
        d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    est, lo, hi = _mean_ci(d)
    n = int(np.sum(np.isfinite(d)))
    n_inf = int(d.size - n)
    note = (note + "; " if note else "") + f"parity margin ±{margin:g}"
    if n_inf:
        note += f"; {n_inf} seed(s) diverged on one side"
    if n_inf > d.size // 2:
        verdict = NOT_REPRODUCED  # most seeds diverged on one side: no parity whatever the rest say
    elif n < MIN_PAIRS or not (math.isfinite(lo) and math.isfinite(hi)):
        verdict = INCONCLUSIVE
    elif -margin <= lo and hi <= margin:
        verdict = REPRODUCED
    elif hi < -margin or lo > margin:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return Finding(measure, paper, est, lo, hi, n, verdict, note)


def share(measure: str, paper: str, hits: int, n: int, claimed: str, threshold: float,
          note: str = "") -> Finding:
    """A rate ``hits / n`` with its exact (Clopper–Pearson) 95 % interval; the source says it is
    ``claimed`` ("above" or "below") ``threshold``."""
    if claimed not in ("above", "below"):
        raise ValueError(f"claimed must be 'above' or 'below', got {claimed!r}")
    if n == 0:
        return Finding(measure, paper, math.nan, math.nan, math.nan, 0, INCONCLUSIVE, note)
    lo, hi = clopper_pearson(hits, n)
    if n < MIN_PAIRS:
        verdict = INCONCLUSIVE
    elif (lo > threshold) if claimed == "above" else (hi < threshold):
        verdict = REPRODUCED
    elif (hi < threshold) if claimed == "above" else (lo > threshold):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return Finding(measure, paper, hits / n, lo, hi, int(n), verdict, note)
