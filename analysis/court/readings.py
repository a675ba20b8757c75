"""The fp16-RL scaler court's readings (issue 30): per workload × cell, from the court's runs.

A **cell** is one setting of the court (``conf/experiment/court.yaml``): an fp16 strategy option
(a rule, a shipped preset or a folk remedy), the LM head kept in fp32 (``native`` with
``model.keep_fp32``), bf16 and the fp32 reference (both strategy ``none``). Runs of one seed share
init, data and rollout order, so every difference is **paired by seed**
(:func:`analysis.paired.paired_stats`: mean difference with its 95 % BCa bootstrap interval,
paired t (Holm over the cells of one workload) and Wilcoxon, the reading of
:func:`analysis.paired.reading`).

Per cell:

* **P(run survives)** = k / n, k runs completed out of the n that ended (``incomplete`` runs are
  left out), with its Clopper–Pearson 95 % interval (:func:`analysis.stats.clopper_pearson`);
* the **primary metric**, as the workload declares it (``regime.primary``, carried by each run's
  ``summary.json`` ``primary``; :func:`primary_for`): ``final_reward`` on ``rl``, higher is
  better; ``final_eval_loss`` on ``finetune``, lower is better: mean over completed runs [BCa interval]; **Δ against GradScaler**
  (the fp16 ``native`` cell) and **Δ against fp32** (strategy ``none`` at fp32), per seed
  ``cell − baseline``, mean [95 % CI]. A run that did not survive (diverged, stalled) loses its
  seed: it enters ``P(better)`` and the Wilcoxon ranks as worse than any finished run and is left
  out of the mean difference (as in :mod:`analysis.paired`); a failed run (an error of the code,
  not of the scaler) is left out;
* **Δ lost-gradient fraction** (``fidelity_lost_frac_mean``: entries nonzero in the fp32 gradient
  at the same weights but zero in fp16) against GradScaler, paired;
* **skipped steps** per run, mean [BCa interval].

A cell is **inconclusive** when its reading against GradScaler on the primary metric is not
*clearly* better or worse. The **recommendation** (:func:`recommend`) is made among the fp16
cells only: the cell with the best mean (fewest lost seeds first) is recommended only when, paired
by seed against every other fp16 cell, it reads *clearly better* (:func:`analysis.paired.reading`:
the interval of the difference excludes 0 in its favour, the paired t-test, Holm-adjusted over
those comparisons, and the Wilcoxon test agree; where only runs that did not survive differ,
the interval of P(better) lies above ½); otherwise the page says *tie* and names the
cells it cannot be told apart from. Only cells with at least :data:`MIN_SEEDS` seeds take part.
An exact tie (the same value on every seed) is a tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from experiments.schema import PRIMARY_BETTER, PRIMARY_DEFAULT

from analysis.metrics import label
from analysis.paired import holm, paired_stats, reading
from analysis.stats import bootstrap_ci, clopper_pearson
from analysis.text import code, fmt_ci
from analysis.words import CLEARLY_BETTER, CLEARLY_WORSE

__all__ = ["BASE_CELL", "COURT_CELLS", "COURT_STRATEGIES", "CourtCell", "KEEP_CELL", "LOST",
           "MIN_SEEDS", "Primary", "WORKLOADS", "REF_CELL", "Verdict", "cell_name", "court_cells",
           "court_rows",
           "format_row", "is_inconclusive", "per_seed", "primary_for", "recommend"]


@dataclass(frozen=True)
class Primary:
    """A workload's primary metric: summary ``column``, its ``label`` and ``higher`` (whether
    higher is better; the statistics read ``-value`` then, so lower is always better inside)."""

    column: str
    label: str
    higher: bool

    def sign(self) -> float:
        return -1.0 if self.higher else 1.0


#: The court's workloads (regime names of its runs), in page order.
WORKLOADS = ("rl", "finetune")


def primary_for(runs: pd.DataFrame, workload: str) -> Primary:
    """The primary metric ``workload``'s runs carry (the ``primary`` column, from each summary
    through :func:`experiments.schema.primary_of`; the most common where runs disagree), its
    direction from :data:`experiments.schema.PRIMARY_BETTER`; ``final_eval_loss`` with no runs."""
    wl = runs[runs["regime"] == workload] if "regime" in runs else runs.iloc[:0]
    named = wl["primary"].dropna() if "primary" in wl else pd.Series(dtype=object)
    column = str(named.mode().iloc[0]) if len(named) else PRIMARY_DEFAULT
    return Primary(column, label(column), higher=PRIMARY_BETTER[column] == "higher")

#: The fp16 strategy options of the court, in ``conf/experiment/court.yaml``'s order.
COURT_STRATEGIES = ("native", "verl", "areal", "oat", "megatron", "static8", "min_scale_1e-10",
                    "fairseq_tolerance", "hysteresis2", "init_2p32", "metaseq", "none")
BASE_CELL, REF_CELL = "native", "fp32"
KEEP_CELL = "native + keep head fp32"
#: Every cell the court runs, in page order: fp16 options, the keep-in-fp32 remedy, bf16, fp32.
COURT_CELLS = (*COURT_STRATEGIES, KEEP_CELL, "bf16", REF_CELL)

#: Fewest paired seeds a recommendation rests on (2 seeds: a bootstrap of 3 distinct resamples).
MIN_SEEDS = 3
_DROPPED = ("failed", "incomplete")  # not the scaler's outcome: left out
LOST = "fidelity_lost_frac_mean"


def _keep(value: object) -> list[str]:
    if isinstance(value, (list, tuple, np.ndarray)):
        return [str(v) for v in value]
    return [] if value is None or (isinstance(value, float) and np.isnan(value)) or value == "" \
        else [str(value)]


def cell_name(strategy: str, precision: str, keep_fp32: object = None) -> str:
    """The court's name of a run's cell: the strategy option at fp16, ``+ keep <modules> fp32``
    when modules ran in fp32, the precision alone for the ``none`` runs at bf16 / fp32."""
    keep = _keep(keep_fp32)
    name = strategy + (f" + keep {','.join(keep)} fp32" if keep else "")
    if precision == "fp16":
        return name
    return precision if strategy == "none" and not keep else f"{precision} {name}"


@dataclass
class CourtCell:
    """One cell's runs on one workload: ``runs`` (rows of the runs table)."""

    name: str
    runs: pd.DataFrame

    def survived(self) -> tuple[int, int]:
        """(k completed, n ended)."""
        ended = self.runs[~self.runs["status"].isin(_DROPPED)]
        return int((ended["status"] == "completed").sum()), int(len(ended))


def court_cells(runs: pd.DataFrame, workload: str) -> dict[str, CourtCell]:
    """The cells of ``workload`` (regime name) in ``runs``, keyed by :func:`cell_name`."""
    if runs.empty or "regime" not in runs:
        return {}
    wl = runs[runs["regime"] == workload]
    if wl.empty:
        return {}
    keep = wl["keep_fp32"] if "keep_fp32" in wl else pd.Series(None, index=wl.index)
    option = wl["strategy_option"] if "strategy_option" in wl else wl["strategy"]
    names = [cell_name(str(s), str(p), k) for s, p, k in zip(option, wl["precision"], keep)]
    return {n: CourtCell(n, g) for n, g in wl.groupby(pd.Series(names, index=wl.index))}


def per_seed(cell: CourtCell, column: str, sign: float = 1.0, *, loses: bool = True) -> pd.Series:
    """One value per seed, lower is better (``sign`` × the column): a completed run's finite
    value; ``+inf`` for a run that did not survive when ``loses`` (else NaN); failed and
    incomplete runs left out; the mean where a seed ran more than once."""
    r = cell.runs
    vals = sign * pd.to_numeric(r[column], errors="coerce") if column in r else \
        pd.Series(np.nan, index=r.index)
    done = (r["status"] == "completed") & np.isfinite(vals)
    lost = ~r["status"].isin((*_DROPPED, "completed"))
    vals = vals.where(done, np.inf if loses else np.nan).where(done | lost, np.nan)
    with np.errstate(all="ignore"):
        return vals.groupby(r["seed"]).mean().dropna()


def _paired(a: pd.Series, b: pd.Series) -> dict[str, float]:
    seeds = a.index.intersection(b.index)
    return paired_stats(a[seeds].to_numpy(), b[seeds].to_numpy())


def _flip(d: dict[str, float], sign: float) -> tuple[float, float, float]:
    """The paired difference in the metric's own direction: (Δ, lo, hi)."""
    m, lo, hi = d["paired_diff"], d["paired_diff_lo"], d["paired_diff_hi"]
    return (m, lo, hi) if sign > 0 else (-m, -hi, -lo)


def court_rows(cells: dict[str, CourtCell], primary: Primary) -> pd.DataFrame:
    """One row per cell of :data:`COURT_CELLS` (cells with no runs included, ``n`` = 0) and any
    other cell found: survival, the primary metric, Δ against GradScaler and fp32, Δ lost
    fraction, skips, and the reading against GradScaler (Holm over the workload's cells)."""
    sign = primary.sign()
    base, ref = cells.get(BASE_CELL), cells.get(REF_CELL)
    base_v = per_seed(base, primary.column, sign) if base else pd.Series(dtype=float)
    ref_v = per_seed(ref, primary.column, sign) if ref else pd.Series(dtype=float)
    base_l = per_seed(base, LOST, loses=False) if base else pd.Series(dtype=float)
    rows = []
    for name in [*COURT_CELLS, *sorted(set(cells) - set(COURT_CELLS))]:
        c = cells.get(name)
        row: dict[str, object] = {"cell": name, "n": 0}
        if c is None:
            rows.append(row)
            continue
        k, n = c.survived()
        row.update(n=n, survived=k, p_survive=k / n if n else np.nan)
        row["p_survive_lo"], row["p_survive_hi"] = clopper_pearson(k, n) if n else (np.nan,) * 2
        done = c.runs[c.runs["status"] == "completed"]
        v = pd.to_numeric(done.get(primary.column), errors="coerce").dropna().to_numpy(float)
        row["mean"] = float(v.mean()) if v.size else np.nan
        row["mean_lo"], row["mean_hi"] = bootstrap_ci(v)
        sk = pd.to_numeric(done.get("skipped_steps"), errors="coerce").dropna().to_numpy(float)
        row["skips"] = float(sk.mean()) if sk.size else np.nan
        row["skips_lo"], row["skips_hi"] = bootstrap_ci(sk)
        x = per_seed(c, primary.column, sign)
        if name != BASE_CELL and base is not None:
            vs = _paired(x, base_v)
            row.update({f"native_{k}": v for k, v in vs.items()})
            row["d_native"], row["d_native_lo"], row["d_native_hi"] = _flip(vs, sign)
            lost = _paired(per_seed(c, LOST, loses=False), base_l)
            row["d_lost"], row["d_lost_lo"], row["d_lost_hi"] = _flip(lost, 1.0)
        if name != REF_CELL and ref is not None:
            row["d_fp32"], row["d_fp32_lo"], row["d_fp32_hi"] = _flip(_paired(x, ref_v), sign)
        rows.append(row)
    df = pd.DataFrame(rows)
    if "native_paired_t_p" in df:
        df["native_paired_t_p_holm"] = holm(df["native_paired_t_p"].to_numpy(dtype=float))
        df["reading"] = [reading({k[7:]: r[k] for k in r if k.startswith("native_")})
                         if np.isfinite(r.get("native_n_pairs", np.nan)) else ""
                         for r in df.to_dict("records")]
    return df


@dataclass
class Verdict:
    """The court's call on one workload: ``recommended`` (a cell name, or ``""`` for a tie),
    the ``leader`` (best mean), the cells ``tied`` with it and one sentence ``text``."""

    recommended: str
    leader: str
    tied: list[str]
    text: str


def recommend(cells: dict[str, CourtCell], primary: Primary) -> Verdict:
    """The fp16 cell to recommend, or a tie (the rule in the module docstring)."""
    sign = primary.sign()
    fp16 = {n: per_seed(c, primary.column, sign) for n, c in cells.items()
            if n in COURT_CELLS[:-2] or (n not in COURT_CELLS and not n.startswith(("bf16", "fp")))}
    fp16 = {n: v for n, v in fp16.items() if len(v) >= MIN_SEEDS}
    if len(fp16) < 2:
        return Verdict("", "", [], f"not enough fp16 cells with {MIN_SEEDS} or more seeds to "
                       "compare: no recommendation")

    def key(n: str) -> tuple[float, float, str]:
        v = fp16[n].to_numpy()
        finite = v[np.isfinite(v)]
        return (float(np.mean(~np.isfinite(v))), float(finite.mean()) if finite.size else np.inf, n)

    leader = min(fp16, key=key)
    others = sorted(set(fp16) - {leader})
    pairs = [_paired(fp16[leader], fp16[o]) for o in others]
    for d, p_holm in zip(pairs, holm([d["paired_t_p"] for d in pairs])):
        d["paired_t_p_holm"] = p_holm
    tied = [o for o, d in zip(others, pairs) if not _separated(d)]
    if not tied:
        return Verdict(leader, leader, [], f"recommended: {code(leader)} — paired by seed, its "
                       f"{primary.label} reads {CLEARLY_BETTER} than every other fp16 cell's (each "
                       "interval of the difference excludes 0; paired t, Holm, and Wilcoxon agree)")
    names = ", ".join(code(n) for n in [leader, *tied])
    return Verdict("", leader, tied, f"tie: {names} — {code(leader)} has the best mean "
                   f"{primary.label}, but paired by seed it is not {CLEARLY_BETTER} than "
                   f"{', '.join(code(n) for n in tied)} (an interval of the difference includes 0, "
                   "or the tests do not agree): the runs cannot tell them apart")


def _separated(d: dict[str, float]) -> bool:
    """The leader is separated from one other cell: read clearly better (:func:`reading`), or,
    where only runs that did not survive differ (no finite interval), P(better)'s interval is
    above ½ — with at least :data:`MIN_SEEDS` pairs either way."""
    if d["n_pairs"] < MIN_SEEDS:
        return False
    if np.isfinite(d["paired_diff_lo"]) and np.isfinite(d["paired_diff_hi"]):
        return reading(d) == CLEARLY_BETTER
    return bool(d["p_better_lo"] > 0.5)


def is_inconclusive(row: dict[str, object]) -> bool:
    """A cell whose reading against GradScaler is not clearly better or worse."""
    return row.get("reading") not in (CLEARLY_BETTER, CLEARLY_WORSE)


def format_row(r: dict[str, object], primary: Primary) -> list[str]:
    """One row of the page's table."""
    if not r.get("n"):
        return [code(r["cell"]), "no runs", *["–"] * 6]
    g = lambda k: r.get(k, np.nan)  # noqa: E731
    return [code(r["cell"]),
            f"{int(g('survived'))}/{int(g('n'))}: "
            + fmt_ci(g("p_survive"), g("p_survive_lo"), g("p_survive_hi"), prob_=True),
            fmt_ci(g("mean"), g("mean_lo"), g("mean_hi")),
            "baseline" if r["cell"] == BASE_CELL else fmt_ci(g("d_native"), g("d_native_lo"),
                                                             g("d_native_hi")),
            "reference" if r["cell"] == REF_CELL else fmt_ci(g("d_fp32"), g("d_fp32_lo"),
                                                             g("d_fp32_hi")),
            "baseline" if r["cell"] == BASE_CELL else fmt_ci(g("d_lost"), g("d_lost_lo"),
                                                             g("d_lost_hi")),
            fmt_ci(g("skips"), g("skips_lo"), g("skips_hi")),
            str(r.get("reading") or "–") if r["cell"] != BASE_CELL else "baseline"]

