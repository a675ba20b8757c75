"""Loading run records: every run kept and labelled, corrupt lines skipped and reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from analysis import runset
from analysis.load import (RunLoadError, iter_metrics, load_runs, load_wandb,
                           wandb_rows_to_lines)
from tests.analysis.synth import LAYERS, WORKLOAD, SweepSpec, write_sweep


def test_every_run_is_kept_with_its_status(sweep):
    root, info = sweep
    rs = load_runs(root)
    assert len(rs.runs) == info["n_runs"]
    status = dict(zip(rs.runs["run_id"], rs.runs["status"]))
    ex = info["extras"]
    assert status[f"synthetic/{ex['failed']}"] == "failed"
    assert status[f"synthetic/{ex['diverged']}"] == "diverged"
    assert status[f"synthetic/{ex['incomplete']}"] == "incomplete"
    assert status[f"synthetic/{ex['no_records']}"] == "incomplete"
    assert sum(s == "completed" for s in status.values()) == info["n_runs"] - 4
    failed = rs.runs[rs.runs["status"] == "failed"].iloc[0]
    assert "synthetic failure" in failed["error"]


def test_summary_values_round_trip(sweep):
    root, info = sweep
    rs = load_runs(root)
    done = rs.runs[rs.runs["status"] == "completed"]
    for (strategy, precision), finals in info["finals"].items():
        got = done[(done["strategy"] == strategy) & (done["precision"] == precision)]
        assert sorted(got["final_eval_loss"]) == pytest.approx(sorted(finals))
        assert set(got["workload"]) == {WORKLOAD}


def test_identity_of_a_run_without_summary_comes_from_hydra_overrides(sweep):
    root, info = sweep
    rs = load_runs(root)
    row = rs.runs[rs.runs["run_id"] == f"synthetic/{info['extras']['no_records']}"].iloc[0]
    assert (row["strategy"], row["precision"], row["seed"]) == ("layerwise", "fp16", 96)
    assert row["error"] == "no summary.json"


def test_corrupt_line_is_skipped_and_reported(sweep):
    root, info = sweep
    rs = load_runs(root)
    inc = f"synthetic/{info['extras']['incomplete']}"
    assert len(rs.problems) == 1 and "corrupt line skipped" in rs.problems[0]
    steps = rs.train[rs.train["run_id"] == inc]["step"].tolist()
    assert steps == [5, 10, 15, 20]  # the truncated step-25 line is gone, the rest kept


def test_step_tables_are_tidy(sweep):
    root, _ = sweep
    rs = load_runs(root)
    one = rs.runs[(rs.runs["strategy"] == "layerwise") & (rs.runs["status"] == "completed")]
    rid = one["run_id"].iloc[0]
    train = rs.train[rs.train["run_id"] == rid]
    assert train["step"].tolist() == list(range(5, 41, 5))
    layers = rs.layers[rs.layers["run_id"] == rid]
    assert len(layers) == len(train) * len(LAYERS)
    assert layers.groupby("layer")["layer_order"].first().to_dict() == {n: i for i, n in
                                                                        enumerate(LAYERS)}
    gs = rs.group_scales[rs.group_scales["run_id"] == rid]
    first = gs[gs["step"] == 5].sort_values("group_order")
    assert first["group"].tolist() == list(LAYERS)
    assert first["scale"].tolist() == [65536.0, 32768.0, 16384.0]
    # per-run aggregate = mean over steps of the mean over layers
    assert one["act_zero_frac_mean"].iloc[0] == pytest.approx(layers["act_zero_frac"].mean())
    evals = rs.evals[rs.evals["run_id"] == rid]
    assert evals["step"].tolist() == [20, 40]
    assert evals["eval_loss"].iloc[-1] == pytest.approx(one["final_eval_loss"].iloc[0])
    hist = rs.exp_hist[rs.exp_hist["run_id"] == rid]
    assert set(hist["step"]) == {5, 15, 25, 35}  # every other logged step carries a histogram
    assert rs.group_scales[rs.group_scales["strategy"] != "layerwise"].empty


def test_non_finite_values_survive(tmp_path: Path):
    write_sweep(tmp_path / "s", SweepSpec(true_loss={"native": 0.7}, seeds=1, extras=True,
                                          fp32_reference=False))
    rs = load_runs(tmp_path / "s")
    div = rs.train[rs.train["status"] == "diverged"]
    assert math.isinf(div["loss"].iloc[-1])


def test_several_sweeps_keep_distinct_ids(tmp_path: Path):
    spec = SweepSpec(true_loss={"native": 0.7}, seeds=2, extras=False, fp32_reference=False)
    write_sweep(tmp_path / "a", spec)
    write_sweep(tmp_path / "b", spec)
    rs = load_runs([tmp_path / "a", tmp_path / "b"])
    assert len(rs.runs) == 4 and rs.runs["run_id"].is_unique
    assert {r.split("/")[0] for r in rs.runs["run_id"]} == {"a", "b"}


def test_missing_and_empty_directories_raise_clear_errors(tmp_path: Path):
    with pytest.raises(RunLoadError, match="does not exist"):
        load_runs(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunLoadError, match="no run records"):
        load_runs(tmp_path / "empty")


def test_unreadable_summary_is_reported_and_run_kept(tmp_path: Path):
    write_sweep(tmp_path / "s", SweepSpec(true_loss={"native": 0.7}, seeds=1, extras=False,
                                          fp32_reference=False))
    (tmp_path / "s" / "0" / "summary.json").write_text("{not json", encoding="utf-8")
    rs = load_runs(tmp_path / "s")
    assert rs.runs["status"].tolist() == ["incomplete"]
    assert rs.runs["strategy"].tolist() == ["native"]  # from .hydra/overrides.yaml
    assert any("unreadable summary" in p for p in rs.problems)


def test_wandb_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(RunLoadError, match="WANDB_MODE=offline"):
        load_wandb("me/scalelab", group="compare")
    with pytest.raises(RunLoadError, match="entity/project"):
        load_wandb("just-a-project")


def _as_wandb_rows(lines: list[dict]) -> list[dict]:
    """What the app's W&B logger (experiments/app/records.py) stores: keys under train/ or eval/,
    dicts flattened with '/', the histogram as a wandb.Histogram, lines of one step merged."""
    rows: dict[int, dict] = {}
    for line in lines:
        prefix = line["kind"] + "/"
        row = rows.setdefault(line["step"], {"_step": line["step"], "_runtime": 1.0})
        for k, v in line.items():
            if k in ("kind", "step"):
                continue
            if k == "act_exp_hist":
                n = len(v["counts"])
                row[prefix + k] = {"_type": "histogram", "values": v["counts"],
                                   "bins": list(range(v["lo"], v["lo"] + n + 1))}
            elif isinstance(v, dict):
                row.update({f"{prefix}{k}/{kk}": vv for kk, vv in v.items()})
            else:
                row[prefix + k] = v
    return list(rows.values())


def test_wandb_rows_map_back_to_run_record_lines(sweep):
    root, _ = sweep
    lines = [json.loads(x) for x in (root / "3" / "metrics.jsonl").read_text().splitlines()]
    back = list(wandb_rows_to_lines(_as_wandb_rows(lines)))
    assert [(b["kind"], b["step"]) for b in back] == [(x["kind"], x["step"]) for x in lines]
    for b, x in zip(back, lines):
        if "act_exp_hist" in x:
            assert b["act_exp_hist"] == dict(x["act_exp_hist"], zeros=0)  # W&B drops zeros
            b, x = dict(b), dict(x)
            del b["act_exp_hist"], x["act_exp_hist"]
        assert b == x


class _WandbRun:
    """The attributes of ``wandb.apis.public.Run`` that :func:`load_wandb` reads."""

    def __init__(self, run_dir: Path, rid: str, state: str) -> None:
        self.id, self.state, self.url, self.group = rid, state, f"https://wandb/{rid}", "g"
        self.summary = json.loads((run_dir / "summary.json").read_text())
        self.config = {}
        self._rows = _as_wandb_rows([json.loads(x) for x in
                                     (run_dir / "metrics.jsonl").read_text().splitlines()
                                     if x.strip().endswith("}")])

    def scan_history(self):
        return iter(self._rows)


class _WandbApi:
    def __init__(self, runs):
        self._runs = runs
        self.calls = []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return self._runs


def test_wandb_runs_load_like_local_runs(sweep):
    root, info = sweep
    finished = _WandbRun(root / "0", "a1", "finished")
    running = _WandbRun(root / info["extras"]["incomplete"], "b2", "crashed")
    api = _WandbApi([finished, running])
    rs = load_wandb("me/scalelab", group="compare", api=api)
    local = load_runs(root)
    assert api.calls == [("me/scalelab", {"group": "compare"})]
    assert rs.runs["status"].tolist() == ["completed", "incomplete"]
    for table in ("train", "evals", "layers"):
        a = getattr(rs, table)
        b = getattr(local, table)
        a = a[a["run_id"] == "me/scalelab/a1"].drop(columns=["run_id"]).reset_index(drop=True)
        b = b[b["run_id"] == "synthetic/0"].drop(columns=["run_id"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(a, b, check_dtype=False)


def test_fidelity_lines_load_and_unknown_kinds_are_reported(tmp_path: Path):
    """Today's records plus the fidelity probe's lines (experiments.schema.FIDELITY_FIELDS):
    they fill the ``fidelity`` table; a line of a kind no schema knows is skipped and said."""
    write_sweep(tmp_path / "s", SweepSpec(true_loss={"native": 0.7}, seeds=1, extras=False,
                                          fp32_reference=False, steps=10))
    path = tmp_path / "s" / "0" / "metrics.jsonl"
    with path.open("a", encoding="utf-8") as fh:
        for step, cos in ((5, 0.99), (10, 0.98)):
            fh.write(json.dumps({"kind": "fidelity", "step": step, "cosine": cos,
                                 "rel_err": 1 - cos, "lost_frac": 0.01,
                                 "layer_cosine": {"fc1": cos}, "layer_rel_err": {"fc1": 0.1},
                                 "layer_lost_frac": {"fc1": 0.0}, "fidelity_probe_s": 0.002}) + "\n")
        fh.write(json.dumps({"kind": "future", "step": 10}) + "\n")
    rs = load_runs(tmp_path / "s")
    assert rs.fidelity["cosine"].tolist() == [0.99, 0.98]
    assert rs.fidelity["step"].tolist() == [5, 10]
    assert set(rs.fidelity["strategy"]) == {"native"}
    assert len(rs.problems) == 1 and "no known kind" in rs.problems[0]
    assert rs.runs["status"].tolist() == ["completed"]


def test_analysis_keys_come_from_the_schema():
    """Every per-run metric the report compares is a summary field of experiments.schema, a
    per-run aggregate of a train-line field the loader computes, or the time to target (from
    the schema's train-line ``loss_avg``/``loss``, :mod:`analysis.targets`)."""
    from experiments.schema import PRIMARY_BETTER, SUMMARY_FIELDS, TRAIN_FIELDS

    from analysis.runset import SUMMARY_COLUMNS, TRAIN_SCALARS
    from analysis.metrics import METRICS
    from analysis.targets import COLUMN

    assert set(SUMMARY_COLUMNS) == set(SUMMARY_FIELDS) - {"fingerprint", "segments"}
    assert set(TRAIN_SCALARS) <= set(TRAIN_FIELDS)
    assert {"loss", "loss_avg"} <= set(TRAIN_SCALARS)
    assert set(PRIMARY_BETTER) <= set(SUMMARY_FIELDS)  # final_primary: one of these, signed
    for m in METRICS:
        assert (m.column in SUMMARY_FIELDS or m.column.removesuffix("_mean") in TRAIN_FIELDS
                or m.column in (COLUMN, "final_primary")), m


def test_metrics_read_limits_keep_every_whole_line_before_them(tmp_path: Path):
    """Issue 20: the per-line and per-file limits of metrics.jsonl. A line over the line limit
    is skipped and named; the file limit stops reading, naming the line where it cut; a file
    that ends exactly at the limit loses nothing and says nothing."""
    path = tmp_path / "metrics.jsonl"
    line = json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n"
    n = len(line)
    cases = [  # (content, max_bytes, max_line) -> (lines kept, problems)
        (line * 3, 3 * n, 1000, 3, []),
        (line * 3, 2 * n + 5, 1000, 2,
         [f"{path}: over the {2 * n + 5} bytes read limit; line 3 (cut there) and later lines "
          "ignored"]),
        (line * 3, 2 * n, 1000, 2,
         [f"{path}: over the {2 * n} bytes read limit; lines after line 2 ignored"]),
        (line + "x" * 100 + "\n" + line, 10_000, 50, 2,
         [f"{path}:2: line longer than 50 bytes skipped"]),
        (line * 2 + line[:-1], 3 * n - 1, 1000, 3, []),
    ]
    for content, max_bytes, max_line, kept, said in cases:
        path.write_text(content, encoding="utf-8")
        problems: list[str] = []
        got = list(iter_metrics(path, problems, max_bytes=max_bytes, max_line=max_line))
        assert (len(got), problems) == (kept, said), (max_bytes, max_line)


def test_tables_built_in_chunks_equal_tables_built_at_once(tmp_path: Path, monkeypatch):
    """Issue 20: the per-step tables are turned into DataFrames every CHUNK_ROWS rows (memory);
    the result is the same as one DataFrame of every row, dtypes included (a column missing
    from a whole chunk but a number elsewhere is still a float column)."""
    root = tmp_path / "s"
    write_sweep(root, SweepSpec(fidelity_every=10))
    path = root / "0" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    for line in lines:
        line.setdefault("probe_time_s", 0.5)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    whole = load_runs(root)
    assert whole.train["probe_time_s"].dtype == float
    monkeypatch.setattr(runset, "CHUNK_ROWS", 7)
    chunked = load_runs(root)
    for name in ("train", "evals", "fidelity", "layers", "group_scales", "exp_hist"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert len(a) > 7 or name in ("evals", "fidelity"), name
        assert set(a.columns) == set(b.columns), name
        pd.testing.assert_frame_equal(a, b[a.columns])
    pd.testing.assert_frame_equal(whole.runs, chunked.runs)
