"""Which strategy when: one row per regime (workload) × precision, the best strategy there, its
paired effect against ``native`` and against the fp32 run of the same seed, and a one-line
reason made from the numbers (issue 12, item 5).

**The order in which the metrics are read** (:data:`ORDER`): the primary metric (final eval loss; −reward on rl), then time to
target, then lost gradient entries, then 1 − cosine to fp32, then skipped steps. (The
activation-gradient zero fraction is not read: it counts structural zeros such as ReLU's too;
lost gradient entries measure the underflow against fp32 directly. Strategy overhead is wall-clock
time, which machine load moves between runs of the same code: it never decides, issue 30.)

**Best** = among the strategies whose paired reading against ``native``
(:func:`analysis.paired.reading`, in ``comparisons.csv``) is *clearly better* on the earliest
metric in that order for which any strategy has one, the one with the lowest mean paired
difference — and where several share it as the page shows it (the same paired Δ and interval
to 3 significant digits, e.g. two rules that chose the same scales), none is called best: the
row reads **tie** and names them all (``tied``), whatever their order. The order is lexicographic: a strategy read *clearly
worse* than ``native`` on an earlier metric is not called best on a later one. When no strategy is
clearly better on any metric, none is called best and the row says what the paired readings say:

* *better in these seeds, but too few seeds* — some strategy reads so on some metric (the
  earliest such metric is named, with that strategy's effect);
* *no detectable difference* — no strategy reads better on any metric and at least one reading
  is "no detectable difference" (the others worse);
* ``native`` is named best when every comparable reading of every other strategy is worse;
* *not comparable* — fewer than 2 paired seeds everywhere.

A cell without ``native`` (e.g. a bf16 control with only ``none``) is compared with the fp32
run of the same seed only: the row shows the strategy with the smallest paired loss gap. Cells
at fp32 have no row. Readings are written in their exact words (:mod:`analysis.words`).
"""

from __future__ import annotations

import pandas as pd

from analysis.metrics import (FINAL_PRIMARY, LOST_ENTRIES, ONE_MINUS_COS, PRIMARY,
                              SKIPPED_STEPS, STEPS_TO_TARGET, label)
from analysis.profiles import cross_workload
from analysis.tables import BASELINE, identified
from analysis.targets import REFERENCE_PRECISION
from analysis.text import code, fmt, fmt_ci
from analysis.words import (BETTER_ACROSS, BETTER_FEW, CLEARLY_BETTER, CLEARLY_WORSE,
                            NEGLIGIBLE, NO_DIFFERENCE, NOT_COMPARABLE, TIE, TIE_ACROSS, TIMING,
                            WORSE_ACROSS, WORSE_FEW)

__all__ = ["COLUMNS", "CROSS_CAPTION", "ORDER", "cross_rows", "cross_verdict",
           "cross_workload_table", "order_text", "table_rows", "which_strategy_when"]

#: The metrics the verdict reads, in this order.
ORDER = tuple(m.column for m in (FINAL_PRIMARY, STEPS_TO_TARGET, LOST_ENTRIES, ONE_MINUS_COS,
                                 SKIPPED_STEPS) if not m.timing)
LOSS = FINAL_PRIMARY.label

COLUMNS = ["workload", "regime", "precision", "best_strategy", "tied", "strategy_shown",
           "decided_by",
           "vs_native_diff", "vs_native_lo", "vs_native_hi", "vs_native_reading",
           "vs_fp32_diff", "vs_fp32_lo", "vs_fp32_hi", "vs_fp32_reading", "reason"]


def order_text() -> str:
    """The metric order in words, for the report."""
    return ", then ".join(label(m) for m in ORDER)


def which_strategy_when(runs: pd.DataFrame, comps: pd.DataFrame) -> pd.DataFrame:
    """The table (:data:`COLUMNS`) from the ``runs`` table and the comparisons of
    :func:`analysis.tables.compare_to_baseline` and :func:`~analysis.tables.compare_to_reference`
    concatenated (``comparisons.csv``)."""
    ids = identified(runs)
    if ids.empty:
        return pd.DataFrame(columns=COLUMNS)
    low = ids[ids["precision"] != REFERENCE_PRECISION]
    rows = []
    for (workload, precision), cell in low.groupby(["workload", "precision"], sort=True):
        here = comps[(comps["workload"] == workload) & (comps["precision"] == precision)] \
            if not comps.empty else comps
        regimes = cell["regime"].dropna() if "regime" in cell else pd.Series(dtype=object)
        regime = regimes.iloc[0] if not regimes.empty else str(workload).rsplit("/", 1)[-1]
        row = dict.fromkeys(COLUMNS, "")
        row.update(workload=workload, regime=regime, precision=precision)
        row.update(_cell(sorted(set(cell["strategy"])), here))
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def _cell(strategies: list[str], comps: pd.DataFrame) -> dict[str, object]:
    """Best strategy, its effects and the reason for one workload × precision."""
    native = comps[(comps["baseline"] == BASELINE) & (comps["reading"] != TIMING)] \
        if not comps.empty else comps
    ref = comps[(comps["baseline"] == REFERENCE_PRECISION) & (comps["metric"] == PRIMARY)] \
        if not comps.empty else comps
    if BASELINE not in strategies:
        return _control(strategies, ref)
    metric, cand, dropped = _earliest(native, CLEARLY_BETTER)
    if metric is not None and len(_tied(cand)) > 1:
        names = ", ".join(code(s) for s in _tied(cand))
        out = _shown(cand.iloc[0].strategy, cand.iloc[0], ref, metric, _before(metric)
                     + f"{TIE}: {names} are {CLEARLY_BETTER} than `{BASELINE}` on {label(metric)} "
                     f"with the same paired gain ({_delta(cand.iloc[0])}){dropped}")
        out["tied"] = ", ".join(_tied(cand))
        return out
    if metric is not None:
        best = cand.iloc[0]
        names = ", ".join(code(s) for s in cand["strategy"])
        lead = (f"the only rule {CLEARLY_BETTER} than `{BASELINE}` on {label(metric)}: {names} "
                f"({_delta(best)})" if len(cand) == 1 else
                f"the only rules {CLEARLY_BETTER} than `{BASELINE}` on {label(metric)}: {names}; "
                f"{code(best.strategy)} has the largest paired gain ({_delta(best)})")
        return _shown(best.strategy, best, ref, metric, _before(metric) + lead + dropped,
                      best=True)
    metric, cand, dropped = _earliest(native, BETTER_FEW)
    if metric is not None:
        top = cand.iloc[0]
        names = ", ".join(code(s) for s in cand["strategy"])
        text = (f"no rule {CLEARLY_BETTER} than `{BASELINE}` on any metric; on {label(metric)} "
                f"{names} {'is' if len(cand) == 1 else 'are'} {BETTER_FEW} "
                f"({code(top.strategy)}: {_delta(top)})")
        return _shown(top.strategy, top, ref, metric, text + dropped)
    worse = sorted(set(native.loc[(native["metric"] == PRIMARY)
                                  & native["reading"].isin([CLEARLY_WORSE, WORSE_FEW]),
                                  "strategy"])) if not native.empty else []
    also = f"; worse on {LOSS}: {', '.join(code(s) for s in worse)}" if worse else ""
    readings = set(native["reading"]) if not native.empty else set()
    quiet = [w for w in (NO_DIFFERENCE, NEGLIGIBLE) if w in readings]
    if quiet:
        words = " or ".join(f"'{w}'" for w in quiet)
        out = _shown(BASELINE, None, ref, "", f"no rule better than `{BASELINE}` on any metric "
                     f"(every paired reading is {words} or worse){also}")
        out["vs_native_reading"] = quiet[0]
        return out
    if readings - {NOT_COMPARABLE}:
        return _shown(BASELINE, None, ref, "", "every comparable paired reading of every other "
                      f"rule against `{BASELINE}` is worse{also}", best=True)
    out = _shown(BASELINE, None, ref, "", f"fewer than 2 paired seeds against `{BASELINE}`: "
                 "nothing to compare" if len(strategies) > 1 else
                 f"only `{BASELINE}` ran here: nothing to compare it with")
    out["vs_native_reading"] = NOT_COMPARABLE
    return out


def _control(strategies: list[str], ref: pd.DataFrame) -> dict[str, object]:
    """A cell without ``native``: the strategy with the smallest paired gap to fp32."""
    rows = ref[ref["strategy"].isin(strategies)].sort_values(
        ["paired_diff", "strategy"], na_position="last") if not ref.empty else ref
    shown = rows.iloc[0].strategy if not rows.empty else strategies[0]
    out = _shown(shown, None, ref, "", "")
    gap = (f"{out['vs_fp32_reading']} on {LOSS} ({_delta(rows.iloc[0])})"
           if not rows.empty else "no fp32 run of the same seeds to compare with")
    many = " (smallest paired loss gap of " + ", ".join(code(s) for s in strategies) + ")" \
        if len(strategies) > 1 else ""
    out["reason"] = (f"no `{BASELINE}` here: compared with the fp32 run of the same seed only; "
                     f"{code(shown)}{many} against fp32: {gap}")
    out["vs_native_reading"] = ""
    return out


def _shown(strategy: str, vs_native: pd.Series | None, ref: pd.DataFrame, metric: str,
           reason: str, best: bool = False) -> dict[str, object]:
    out: dict[str, object] = {"best_strategy": strategy if best else "",
                              "strategy_shown": strategy, "decided_by": metric,
                              "reason": reason}
    out.update(_effect("vs_native", vs_native))
    r = ref[ref["strategy"] == strategy] if not ref.empty else ref
    out.update(_effect("vs_fp32", r.iloc[0] if not r.empty else None))
    if r.empty:
        out["vs_fp32_reading"] = NOT_COMPARABLE
    return out


def _effect(prefix: str, c: pd.Series | None) -> dict[str, object]:
    nan = float("nan")
    if c is None:
        return {f"{prefix}_diff": nan, f"{prefix}_lo": nan, f"{prefix}_hi": nan,
                f"{prefix}_reading": ""}
    return {f"{prefix}_diff": c.paired_diff, f"{prefix}_lo": c.paired_diff_lo,
            f"{prefix}_hi": c.paired_diff_hi, f"{prefix}_reading": c.reading}


def _earliest(native: pd.DataFrame, wanted: str) -> tuple[str | None, pd.DataFrame, str]:
    """The earliest metric of :data:`ORDER` on which a strategy reads ``wanted`` against
    ``native``, those strategies (lowest mean paired difference first) and a note on the ones
    left out for reading clearly worse on an earlier metric."""
    out: set[str] = set()
    for metric in ORDER:
        rows = native[native["metric"] == metric] if not native.empty else native
        if rows.empty:
            continue
        hit = rows[rows["reading"] == wanted]
        cand = hit[~hit["strategy"].isin(out)]
        if not cand.empty:
            left = sorted(set(hit["strategy"]) & out)
            note = (f" (not counted, {CLEARLY_WORSE} on an earlier metric: "
                    f"{', '.join(code(s) for s in left)})" if left else "")
            return metric, cand.sort_values(["paired_diff", "strategy"], na_position="last"), note
        out |= set(rows.loc[rows["reading"] == CLEARLY_WORSE, "strategy"])
    return None, native.iloc[0:0], ""


def _tied(cand: pd.DataFrame) -> list[str]:
    """The strategies whose paired Δ and interval read the same as the top one's where the page
    shows them (:func:`analysis.text.fmt`, 3 significant digits): more than one is a tie — a
    pick among them would follow their order or digits below what a deterministic re-run
    repeats (issue 30), never the data."""
    def shown(r: pd.Series) -> tuple[str, ...]:
        return tuple(fmt(r[c]) for c in ("paired_diff", "paired_diff_lo", "paired_diff_hi"))

    top = shown(cand.iloc[0])
    return sorted(r.strategy for _, r in cand.iterrows() if shown(r) == top)


def _before(metric: str) -> str:
    """``nothing clearly better on final eval loss, time to target; `` for the metrics read
    before ``metric``."""
    earlier = ORDER[:ORDER.index(metric)]
    return (f"nothing {CLEARLY_BETTER} on {', '.join(label(m) for m in earlier)}; "
            if earlier else "")


def _delta(c: pd.Series) -> str:
    return "Δ = " + fmt_ci(c.paired_diff, c.paired_diff_lo, c.paired_diff_hi)


def table_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the report's table (numbers formatted, readings verbatim)."""
    ambiguous = df.groupby("regime")["workload"].nunique().gt(1).any() if not df.empty else False
    cols = ["workload" if ambiguous else "regime", "precision", "best strategy", "decided by",
            f"vs `{BASELINE}`: Δ [95% CI], reading", f"vs fp32, {LOSS}: Δ [95% CI], reading",
            "reason"]
    rows = []
    for r in df.itertuples(index=False):
        shown = f"{code(r.strategy_shown)}: "
        tied = f"{TIE}: " + ", ".join(code(s) for s in r.tied.split(", ")) if r.tied else ""
        rows.append([
            code(r.workload if ambiguous else r.regime), code(r.precision),
            tied or (code(r.best_strategy) if r.best_strategy else "–"),
            label(r.decided_by) if r.decided_by else "–",
            _cell_effect(r.vs_native_diff, r.vs_native_lo, r.vs_native_hi, r.vs_native_reading,
                         "" if r.strategy_shown in (r.best_strategy, BASELINE) else shown),
            _cell_effect(r.vs_fp32_diff, r.vs_fp32_lo, r.vs_fp32_hi, r.vs_fp32_reading,
                         "" if r.strategy_shown == r.best_strategy else shown),
            r.reason])
    return cols, rows


def _cell_effect(diff: float, lo: float, hi: float, reading: str, who: str) -> str:
    if not reading:
        return "–"
    value = fmt_ci(diff, lo, hi)
    return f"{who}{value}, {reading}" if value != "–" else f"{who}{reading}"


# --- across workloads: AlgoPerf's performance-profile score beside rliable's aggregates --------

CROSS_CAPTION = (
    "Across workloads (cross_workload.csv; analysis/profiles.py): every workload × precision "
    f"with `{BASELINE}`, strategies run on all of them. {STEPS_TO_TARGET.label.capitalize()} = "
    "steps to the fp32 run's half-time loss, ∞ when missed or diverged; per workload the median "
    "over seeds; "
    "ratio r = time / the fastest strategy's; ρ(τ) = share of workloads with r ≤ τ; score "
    "B = ∫₁⁴ ρ(τ) dτ / 3 (AlgoPerf, Dahl et al. 2023; 1 = fastest everywhere, 0 = never within "
    "4× of it). IQM (rliable) of the speed relative to fp32 (fp32's median time / the run's, 0 "
    "when missed) over all runs; P(faster than `native`) = mean over workloads of P(t < "
    "t_native), ties ½. Intervals: 95% percentile bootstrap resampling seeds within every "
    "workload, the same seeds for every strategy (B − B_native is paired). A winner is named "
    "only when its B − B_native interval excludes 0 and no other strategy's B is within the "
    "interval of its paired difference to the winner's.")


def cross_workload_table(runs: pd.DataFrame, train: pd.DataFrame, *, n_boot: int
                         ) -> tuple[pd.DataFrame, list[str]]:
    """:func:`analysis.profiles.cross_workload` with a ``reading`` per strategy and ``winner``
    (bool), and the workloads profiled / left out as lines.

    The reading follows the per-workload rule (a difference needs an interval that excludes
    0): B − B_native's paired interval above 0 → :data:`BETTER_ACROSS`, below →
    :data:`WORSE_ACROSS`, else :data:`TIE_ACROSS`. **Winner**: the strategy with the highest B,
    when it is ``native`` with every other read worse, or read better than ``native`` itself —
    and in both cases only when every other strategy's B − B_top interval lies below 0 (no tie
    with the runner-up either); else none.
    """
    df, s = cross_workload(runs, train, n_boot=n_boot)
    notes = [f"workloads: {', '.join(s.workloads)}"] if s.workloads else []
    notes += s.left_out
    if df.empty:
        return df.assign(reading=[], winner=[]), notes
    reading = [("" if r.strategy == BASELINE else BETTER_ACROSS if r.b_vs_native_lo > 0
                else WORSE_ACROSS if r.b_vs_native_hi < 0 else TIE_ACROSS)
               for r in df.itertuples(index=False)]
    df = df.assign(reading=reading, winner=False)
    top = df["b"].idxmax()
    others = df.drop(index=top)
    beats_native = (df.loc[top, "reading"] == BETTER_ACROSS if df.loc[top, "strategy"] != BASELINE
                    else (others["reading"] == WORSE_ACROSS).all())
    if beats_native and (others["b_vs_top_hi"] < 0).all():
        df.loc[top, "winner"] = True
    return df, notes


def cross_verdict(df: pd.DataFrame) -> str:
    """One sentence: the cross-workload winner, or why there is none."""
    if df.empty:
        return (f"Across workloads: no workload × precision with `{BASELINE}` and a "
                f"{STEPS_TO_TARGET.label} (an fp32 reference of the same seeds is needed).")
    win = df[df["winner"]]
    better = df[df["reading"] == BETTER_ACROSS].sort_values("b", ascending=False)
    if win.empty and len(better) > 1:
        names = ", ".join(code(x) for x in better["strategy"])
        return (f"Across workloads: no single winner — {names} have a {BETTER_ACROSS}, but "
                "the highest is not separated from the next beyond the interval of their paired "
                "difference.")
    if win.empty:
        return (f"Across workloads: no winner — no strategy's B is separated from `{BASELINE}`'s"
                " beyond its interval in the direction that would name it.")
    r = win.iloc[0]
    if r.strategy == BASELINE:
        return (f"Across workloads: `{BASELINE}` wins — every other strategy's B is below its "
                "beyond the interval.")
    return (f"Across workloads: {code(r.strategy)} wins, B = {fmt_ci(r.b, r.b_lo, r.b_hi)}, "
            f"B − B_native = {fmt_ci(r.b_vs_native, r.b_vs_native_lo, r.b_vs_native_hi)}.")


def cross_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the report's cross-workload table (winner in bold)."""
    cols = ["strategy", "B [95% CI]", f"B − B_{BASELINE} [95% CI]", "ρ(1)",
            "IQM speed vs fp32 [95% CI]", f"P(faster than `{BASELINE}`) [95% CI]", "reading"]
    rows = []
    for r in df.sort_values(["b", "strategy"], ascending=[False, True]).itertuples(index=False):
        name = code(r.strategy)
        rows.append([f"**{name}** (winner)" if r.winner else name, fmt_ci(r.b, r.b_lo, r.b_hi),
                     "–" if r.strategy == BASELINE else
                     fmt_ci(r.b_vs_native, r.b_vs_native_lo, r.b_vs_native_hi),
                     fmt(r.rho_1), fmt_ci(r.iqm, r.iqm_lo, r.iqm_hi),
                     "–" if r.strategy == BASELINE else fmt_ci(r.poi, r.poi_lo, r.poi_hi,
                                                               prob_=True),
                     r.reading or "baseline"])
    return cols, rows
