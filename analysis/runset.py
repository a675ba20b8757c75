"""Tidy tables of a set of runs, built from records already read (local files or W&B).

Every value enters through :mod:`experiments.schema` (``coerce``, by way of
:func:`analysis.records.coerce_fields`): a value of the wrong type (a dict where a number belongs,
a string for a number, a list for a string) becomes ``None`` and is counted as an *issue* of its
run, so nothing downstream ever sees a type it did not expect.

Tables of a :class:`RunSet` (one row per …):

* ``runs``         run: the summary fields, per-run aggregates of the step telemetry, ``status``,
  ``issues`` (a one-line description of what was wrong with its records, or ``None``),
  ``steps_to_target`` (:mod:`analysis.targets`) and the doctor's verdict from ``diagnosis.json``
  (:data:`DIAGNOSIS_COLUMNS`; ``diagnosis`` is its cause, else the summary's);
* ``train``        logged training step (scalar keys only);
* ``evals``        evaluation;
* ``fidelity``     gradient-fidelity probe (cosine, rel_err, lost_frac against fp32);
* ``layers``       (run, step, layer): ``act_zero_frac``, ``act_subnormal_frac``;
* ``group_scales`` (run, step, scale group) for per-group strategies (``layerwise``);
* ``exp_hist``     (run, step, exponent) of the activation-gradient exponent histogram;
* ``blocks``       (run, step, layer, role) of a block-scaled run's casts (``block_stats``): ``blocks``
  and the ``clipped_share``, ``clip_error_share``, ``flushed_share`` and ``zero_scale_share``, and
  ``scale_exp_lo`` / ``scale_exp_hi`` (the span of the block-scale exponent histogram).

Bounds: the per-step tables of all runs together hold at most :data:`MAX_STEP_ROWS` rows (lines
past it are not tabulated, and said). How one record's values are read, cut and counted, and
a run's status: :mod:`analysis.records`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from experiments.schema import (DIAGNOSIS_FIELDS, DIAGNOSIS_NAME, EVAL_FIELDS, FIDELITY_FIELDS,
                                KIND_EVAL, KIND_FIDELITY, KIND_TRAIN, METRICS_NAME,
                                PRIMARY_BETTER, SUMMARY_FIELDS, SUMMARY_NAME, TRAIN_FIELDS,
                                cell_of, coerce, primary_of)

from analysis.records import (MAX_NAME, as_float, cell, classify, coerce_fields, cut, describe_bad,
                              finite_mean, line_problem, segments_note, workload_of)
from analysis.targets import COLUMN as TARGET_COLUMN
from analysis.targets import steps_to_target

__all__ = ["BLOCK_COLUMNS", "CHUNK_ROWS", "Builder", "DIAGNOSIS_COLUMNS", "EVAL_SCALARS", "FIDELITY_SCALARS",
           "IDENTITY_KEYS", "ID_COLUMNS", "MAX_STEP_ROWS", "RunLoadError", "RunSet",
           "SUMMARY_COLUMNS", "TRAIN_SCALARS", "exp_range"]

#: Columns of the ``runs`` table taken from ``summary.json`` (in this order).
SUMMARY_COLUMNS = tuple(k for k in SUMMARY_FIELDS if k not in ("fingerprint", "segments"))

#: Columns of the ``runs`` table from ``diagnosis.json`` (column -> its key there).
DIAGNOSIS_COLUMNS = {"diagnosis": "cause", "diagnosis_module": "first_module",
                     "diagnosis_verdict": "verdict", "diagnosis_fix": "fix",
                     "diagnosis_error": "error"}
_DIAGNOSIS_READ = {k: DIAGNOSIS_FIELDS[k] for k in DIAGNOSIS_COLUMNS.values()}

#: Identity keys read from ``.hydra/overrides.yaml`` when the summary lacks them.
IDENTITY_KEYS = ("strategy", "precision", "model", "data", "regime", "seed")

#: Scalar keys of a train line kept in the ``train`` table.
TRAIN_SCALARS = tuple(k for k, f in TRAIN_FIELDS.items()
                      if f.type in (int, float, bool) and k != "step")
EVAL_SCALARS = tuple(k for k, f in EVAL_FIELDS.items() if f.type in (int, float) and k != "step")
FIDELITY_SCALARS = tuple(k for k, f in FIDELITY_FIELDS.items()
                         if f.type in (int, float, bool) and k != "step")

#: The numbers of a ``block_stats`` entry (``experiments/schema.py``) the ``blocks`` table keeps;
#: ``scale_exp_lo`` / ``scale_exp_hi`` are the lowest and highest scale exponent its
#: ``scale_exp_hist`` counts (:func:`exp_range`).
BLOCK_COLUMNS = ("blocks", "clipped_share", "clip_error_share", "flushed_share", "zero_scale_share")

#: Identity columns copied onto every per-step table so each is usable on its own.
ID_COLUMNS = ("run_id", "strategy", "precision", "workload", "seed", "status")

#: Most rows of the per-step tables (train, evals, fidelity, layers, group_scales, exp_hist)
#: of all runs together: the report's peak stays near 1 GB (1.09 GB measured, train rows only).
MAX_STEP_ROWS = 1_000_000
#: Rows of one per-step table kept as dicts before they become a DataFrame chunk (a dict row
#: takes several times the memory of a DataFrame row).
CHUNK_ROWS = 100_000


class RunLoadError(ValueError):
    """No run records could be found or read (an empty or missing directory)."""


@dataclass
class RunSet:
    """Tidy tables of a set of runs; see the module docstring for each table's rows."""

    runs: pd.DataFrame
    train: pd.DataFrame
    evals: pd.DataFrame
    fidelity: pd.DataFrame
    layers: pd.DataFrame
    group_scales: pd.DataFrame
    exp_hist: pd.DataFrame
    problems: list[str] = field(default_factory=list)
    blocks: pd.DataFrame = field(default_factory=pd.DataFrame)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.runs)


class Builder:
    """Accumulates rows of every table while runs are read one after another.

    ``add_run`` takes raw (untrusted) records: the summary as parsed from JSON (or ``None``),
    the metrics lines as parsed objects (any iterable: it is consumed once, and not past the row
    budget ``max_rows``), and a best-effort ``identity`` (e.g. from Hydra's overrides) used
    where the summary lacks a key. It never raises on record contents. Every bad record is one
    line of :attr:`problems`; a run's own lines (from index ``problems_from`` on, e.g. written
    by the reader of its files) are also summed up in its ``issues``.
    """

    def __init__(self, max_rows: int | None = None) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {
            name: [] for name in ("runs", "train", "evals", "fidelity", "layers",
                                  "group_scales", "exp_hist", "blocks")}
        self.chunks: dict[str, list[pd.DataFrame]] = {name: [] for name in self.rows}
        self.problems: list[str] = []
        self.max_rows = MAX_STEP_ROWS if max_rows is None else max_rows
        self.n_rows = 0

    def add_run(self, run_id: str, run_dir: str, raw_summary: Mapping[str, Any] | None,
                lines: Iterable[Mapping[str, Any]], identity: Mapping[str, Any] | None = None,
                issues: Sequence[str] = (), problems_from: int | None = None,
                raw_diagnosis: Mapping[str, Any] | None = None) -> None:
        issues = list(issues)
        found: list[str] = []  # bad values found here, one line each for ``problems``
        bad: Counter = Counter()
        summary = None if raw_summary is None else coerce_fields(SUMMARY_FIELDS, raw_summary, bad)
        if bad:
            issues.append(describe_bad("summary", bad))
            found.append(describe_bad(f"{run_dir}/{SUMMARY_NAME}", bad))
        src = {k: v for k, v in coerce_fields(SUMMARY_FIELDS, identity or {}, Counter()).items()
               if v is not None}
        src.update({k: v for k, v in (summary or {}).items() if v is not None})
        rec: dict[str, Any] = {"run_id": run_id, "run_dir": run_dir}
        rec.update({col: src.get(col) for col in SUMMARY_COLUMNS})
        diag_bad: Counter = Counter()
        diag = coerce_fields(_DIAGNOSIS_READ, raw_diagnosis or {}, diag_bad)
        if diag_bad:
            issues.append(describe_bad("diagnosis", diag_bad))
            found.append(describe_bad(f"{run_dir}/{DIAGNOSIS_NAME}", diag_bad))
        for col, key in DIAGNOSIS_COLUMNS.items():
            rec[col] = diag.get(key) if diag.get(key) is not None else rec.get(col)
        _label_run(rec, src)
        rec["status"] = classify(summary)
        rec["summary_status"] = None if summary is None else summary.get("status")
        rec["workload"] = workload_of(src)
        rec["regime"] = src.get("regime") or ("plain" if rec["workload"] else None)
        fp = (summary or {}).get("fingerprint") or {}
        rec["git_sha"] = fp.get("git_sha") if isinstance(fp.get("git_sha"), str) else None
        if rec["error"] is None and rec["status"] == "incomplete" and not issues:
            rec["error"] = (f"no {SUMMARY_NAME}" if raw_summary is None
                            else "summary still says 'running' (killed or still training)")
        if (resumed := segments_note((summary or {}).get("segments"))) is not None:
            issues.append(resumed)
        if rec["status"] == "unknown":
            issues.append("summary status is not a status word")
        if any(rec[k] is None for k in ("strategy", "precision", "workload")):
            issues.append("identity incomplete (strategy, precision or workload missing): "
                          "not compared")
        ident = {k: rec[k] for k in ID_COLUMNS}
        line_bad: Counter = Counter()
        counts, zero_fracs, sub_fracs, last_eval, cut_at = self._add_lines(ident, lines,
                                                                           line_bad)
        if line_bad:
            issues.append(describe_bad("metrics", line_bad))
            found.append(describe_bad(f"{run_dir}/{METRICS_NAME}", line_bad))
        if cut_at is not None:
            why = (f"per-step tables full ({self.max_rows} rows in all): metrics lines "
                   + (f"from step {cut_at} on " if cut_at >= 0 else "") + "not tabulated")
            issues.append(why)
            found.append(f"{run_dir}/{METRICS_NAME}: {why}")
        if problems_from is not None and len(self.problems) > problems_from:
            new = [p.split(": ", 1)[-1] for p in self.problems[problems_from:]]
            issues.insert(0, new[0] + (f" (+{len(new) - 1} more)" if len(new) > 1 else ""))
        self.problems.extend(found)
        rec["n_train_lines"], rec["n_eval_lines"] = counts[KIND_TRAIN], counts[KIND_EVAL]
        rec["act_zero_frac_mean"] = finite_mean(zero_fracs)
        rec["act_subnormal_frac_mean"] = finite_mean(sub_fracs)
        if rec["final_eval_loss"] is None and rec["status"] == "incomplete":
            rec["last_eval_loss"] = last_eval
        rec["issues"] = "; ".join(issues) or None
        self.rows["runs"].append(rec)

    def _append(self, table: str, row: dict[str, Any]) -> None:
        rows = self.rows[table]
        rows.append(row)
        self.n_rows += 1
        if len(rows) >= CHUNK_ROWS:
            self.chunks[table].append(pd.DataFrame(rows))
            self.rows[table] = []

    def _table(self, name: str) -> pd.DataFrame:
        """All rows of a per-step table: its chunks and the rows since, dtypes inferred over
        all of them (as one DataFrame of every row would)."""
        rest = [pd.DataFrame(self.rows[name])] if self.rows[name] or not self.chunks[name] \
            else []
        frames = self.chunks[name] + rest
        if len(frames) == 1:
            return frames[0]
        return pd.concat(frames, ignore_index=True).infer_objects()

    def _add_lines(self, ident: dict[str, Any], lines: Iterable[Mapping[str, Any]],
                   bad: Counter
                   ) -> tuple[Counter, list[float], list[float], float | None, int | None]:
        """Tabulate ``lines``; the last item is ``None``, or the step of the first line not
        tabulated because the row budget is spent (``-1`` when none was read)."""
        counts: Counter = Counter()
        zero_fracs: list[float] = []
        sub_fracs: list[float] = []
        last_eval = None
        tables = {KIND_TRAIN: (TRAIN_FIELDS, TRAIN_SCALARS, "train"),
                  KIND_EVAL: (EVAL_FIELDS, EVAL_SCALARS, "evals"),
                  KIND_FIDELITY: (FIDELITY_FIELDS, FIDELITY_SCALARS, "fidelity")}
        if self.n_rows >= self.max_rows:
            return counts, zero_fracs, sub_fracs, last_eval, -1
        for raw in lines:
            if self.n_rows >= self.max_rows:
                step = coerce(TRAIN_FIELDS["step"], raw.get("step")) \
                    if isinstance(raw, Mapping) else None
                return counts, zero_fracs, sub_fracs, last_eval, -1 if step is None else step
            if line_problem(raw) is not None:
                bad["line"] += 1
                continue
            fields, scalars, table = tables[raw["kind"]]
            line = coerce_fields(fields, raw, bad)
            step = line["step"]
            counts[raw["kind"]] += 1
            row = dict(ident, step=step)
            row.update({k: cell(line.get(k)) for k in scalars if k != "kind"})
            self._append(table, row)
            if raw["kind"] == KIND_EVAL:
                last_eval = row.get("eval_loss")
            elif raw["kind"] == KIND_TRAIN:
                self._add_layers(ident, step, line, zero_fracs, sub_fracs)
                self._add_group_scales(ident, step, line)
                self._add_hist(ident, step, line.get("act_exp_hist"), bad)
                self._add_blocks(ident, step, line.get("block_stats"), bad)
        return counts, zero_fracs, sub_fracs, last_eval, None

    def _add_layers(self, ident: dict[str, Any], step: int, line: Mapping[str, Any],
                    zero_fracs: list[float], sub_fracs: list[float]) -> None:
        zero = line.get("act_zero_frac") or {}
        sub = line.get("act_subnormal_frac") or {}
        for values, out in ((zero.values(), zero_fracs), (sub.values(), sub_fracs)):
            mean = finite_mean(values)
            if mean is not None:
                out.append(mean)
        for order, layer in enumerate(dict.fromkeys([*zero, *sub])):
            self._append("layers", dict(ident, step=step, layer=cut(layer, MAX_NAME),
                                        layer_order=order, act_zero_frac=zero.get(layer),
                                        act_subnormal_frac=sub.get(layer)))

    def _add_group_scales(self, ident: dict[str, Any], step: int, line: Mapping[str, Any]
                          ) -> None:
        scales = line.get("scales")
        if not scales:
            return
        names = line.get("scale_groups")
        if not names or len(names) != len(scales):
            names = [f"group{i}" for i in range(len(scales))]
        for order, (name, value) in enumerate(zip(names, scales)):
            self._append("group_scales", dict(ident, step=step, group=cut(name, MAX_NAME),
                                              group_order=order, scale=value))

    def _add_hist(self, ident: dict[str, Any], step: int, hist: Mapping[str, Any] | None,
                  bad: Counter) -> None:
        if hist is None:
            return
        lo, counts = hist.get("lo"), hist.get("counts")
        zeros = as_float(hist.get("zeros")) or 0.0
        if isinstance(lo, bool) or not isinstance(lo, int) or not isinstance(counts, list) \
                or abs(lo) > 10_000 or len(counts) > 10_000:
            bad["act_exp_hist"] += 1
            return
        values = [as_float(c) for c in counts]
        for i, c in enumerate(values):
            if c:
                self._append("exp_hist", dict(ident, step=step, exponent=lo + i, count=c,
                                              zeros=zeros))
        # Keep the zeros of a histogram with no nonzero bins too (all gradients underflowed).
        if not any(values):
            self._append("exp_hist", dict(ident, step=step, exponent=None, count=0.0,
                                          zeros=zeros))

    def _add_blocks(self, ident: dict[str, Any], step: int, stats: Mapping[str, Any] | None,
                    bad: Counter) -> None:
        if stats is None:
            return
        for layer, roles in stats.items():
            if not isinstance(roles, Mapping):
                bad["block_stats"] += 1
                continue
            for role, row in roles.items():
                if not isinstance(row, Mapping):
                    bad["block_stats"] += 1
                    continue
                lo, hi = exp_range(row.get("scale_exp_hist"))
                self._append("blocks", dict(ident, step=step, layer=cut(str(layer), MAX_NAME),
                                            role=cut(str(role), MAX_NAME), scale_exp_lo=lo, scale_exp_hi=hi,
                                            **{k: as_float(row.get(k)) for k in BLOCK_COLUMNS}))

    def build(self, sources: Sequence[str]) -> RunSet:
        runs = pd.DataFrame(self.rows["runs"])
        if not runs.empty:
            runs = runs.sort_values(["workload", "precision", "strategy", "seed", "run_id"],
                                    na_position="last", key=_sort_key).reset_index(drop=True)
        order = {"train": ["step"], "evals": ["step"], "fidelity": ["step"],
                 "layers": ["step", "layer_order"], "group_scales": ["step", "group_order"],
                 "exp_hist": ["step", "exponent"], "blocks": ["step", "layer", "role"]}
        tables = {name: _frame(self._table(name), ["run_id", *keys])
                  for name, keys in order.items()}
        if not runs.empty:
            runs[TARGET_COLUMN] = steps_to_target(runs, tables["train"])
        return RunSet(runs=runs, problems=list(self.problems), sources=list(sources), **tables)


def exp_range(hist: Any) -> tuple[float | None, float | None]:
    """The lowest and highest exponent with a nonzero count of a ``scale_exp_hist``
    (``{"lo": int, "counts": [int]}``, bin ``i`` holding exponent ``lo + i``); ``(None, None)``
    when it counts nothing or is not of that shape."""
    if not isinstance(hist, Mapping) or not isinstance(hist.get("counts"), list):
        return None, None
    lo = as_float(hist.get("lo"))
    counts = [as_float(c) for c in hist["counts"][:4096]]
    used = [i for i, c in enumerate(counts) if c is not None and c > 0]
    if lo is None or not math.isfinite(lo) or not used:
        return None, None
    return lo + used[0], lo + used[-1]


def _label_run(rec: dict[str, Any], src: Mapping[str, Any]) -> None:
    """The run's report identity: ``primary`` (the summary field its workload is ranked by,
    :func:`experiments.schema.primary_of`), ``final_primary`` (that value, lower is better: a
    higher-is-better metric such as the rl reward enters negated), ``strategy_option`` (the
    strategy option as recorded) and ``strategy`` = option + ``cell`` (the court's
    ``native-keep_head_fp32`` is a row of its own, not one more ``native`` run)."""
    rec["primary"] = primary_of(src)
    value = as_float(src.get(rec["primary"]))
    rec["final_primary"] = None if value is None else (
        -value if PRIMARY_BETTER[rec["primary"]] == "higher" else value)
    rec["strategy_option"] = rec["strategy"]
    cell = cut(cell_of(src), MAX_NAME)
    if cell and rec["strategy"] is not None:
        rec["strategy"] = f"{rec['strategy']}{cell}"


def _sort_key(col: pd.Series) -> pd.Series:
    return col.astype(str) if col.name != "seed" else pd.to_numeric(col, errors="coerce")


def _frame(df: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    if df.empty:
        return pd.DataFrame(columns=[*ID_COLUMNS, *order[1:]])
    return df.sort_values(order, na_position="first").reset_index(drop=True)
