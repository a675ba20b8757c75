"""Issue 13, case 4: the report survives any sweep directory.

Each test writes a small sweep in today's format (tests/analysis/synth.py), damages it the way a
crashed job, an old writer or a hostile hand would, and checks that ``scalelab-report`` still
exits 0, that the bad record is listed under "Run status" with a one-line reason, and that the
good runs are still compared. Plus the import boundary: analysis reads records only through
``experiments.schema`` and never imports torch or the training code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load_runs
from analysis.report import main
from tests.analysis.synth import SweepSpec, write_sweep

REPO = Path(__file__).resolve().parents[2]
SPEC = SweepSpec(true_loss={"native": 0.7, "max_ema": 0.5}, seeds=3, steps=20, extras=False)


def _sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    write_sweep(root, SPEC)
    return root


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text(encoding="utf-8"))


def _report(root: Path, tmp_path: Path, capsys) -> tuple[str, str]:
    """Run scalelab-report (warnings are errors); return (report.md, the Run status section)."""
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main([str(root), "--out", str(out), "--n-boot", "200"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    for name in ("report.html", "results.csv", "comparisons.csv", "runs.csv"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text(encoding="utf-8")
    status = md.split("## Run status", 1)[1].split("\n## ", 1)[0]
    return md, status


def _row(status: str, run_id: str) -> str:
    rows = [ln for ln in status.splitlines() if ln.startswith(f"| `{run_id}` |")]
    assert len(rows) == 1, f"{run_id} not listed once in Run status:\n{status}"
    return rows[0]


def _still_compares(md: str) -> None:
    assert "`max_ema` vs `native`: clearly better than native" in md


def test_one_failed_job_without_numbers(tmp_path, capsys):
    root = _sweep(tmp_path)
    s = _summary(root / "0")
    s.update(status="failed", error="RuntimeError: CUDA out of memory", final_eval_loss=None,
             final_train_loss=None, best_eval_loss=None, skipped_steps=None,
             strategy_overhead_frac=None, mean_step_time_s=None)
    (root / "0" / "summary.json").write_text(json.dumps(s))
    md, status = _report(root, tmp_path, capsys)
    row = _row(status, "sweep/0")
    assert "**failed**" in row and "CUDA out of memory" in row


def test_failed_job_of_unknown_identity(tmp_path, capsys):
    """A job that died before writing any record, whose strategy came from an experiment
    preset rather than an override: today's TypeError in the ranking."""
    root = _sweep(tmp_path)
    job = root / "99"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- +experiment=compare\n- seed=7\n")
    md, status = _report(root, tmp_path, capsys)
    assert "**incomplete**" in _row(status, "sweep/99")
    assert "identity incomplete" in _row(status, "sweep/99")
    _still_compares(md)


def test_diverged_and_incomplete_runs(tmp_path, capsys):
    root = _sweep(tmp_path)
    s = _summary(root / "1")
    s.update(status="diverged", diverged=True, final_eval_loss=float("nan"))
    (root / "1" / "summary.json").write_text(json.dumps(s))
    (root / "2" / "summary.json").unlink()
    md, status = _report(root, tmp_path, capsys)
    assert "**diverged**" in _row(status, "sweep/1")
    assert "no summary.json" in _row(status, "sweep/2")


@pytest.mark.parametrize("content, reason", [
    (b"", "unreadable summary (empty)"),
    (b'{"status": "completed", "strategy": "nat', "unreadable summary"),
    (b'[1, 2, 3]', "summary is a JSON list, not an object"),
    (b'"completed"', "summary is a JSON str, not an object"),
])
def test_empty_truncated_or_non_object_summary(tmp_path, capsys, content, reason):
    root = _sweep(tmp_path)
    (root / "4" / "summary.json").write_bytes(content)
    md, status = _report(root, tmp_path, capsys)
    row = _row(status, "sweep/4")
    assert "**incomplete**" in row and reason in row
    assert "`max_ema`" in row and "| 1 |" in row  # identity from .hydra/overrides.yaml


def test_wrong_types_in_summary(tmp_path, capsys):
    root = _sweep(tmp_path)
    s = _summary(root / "3")
    s.update(final_eval_loss={"value": 0.5}, strategy=["native"], seed="1", steps=[1],
             skipped_steps="0", status="completed", fingerprint="not a dict")
    (root / "3" / "summary.json").write_text(json.dumps(s))
    md, status = _report(root, tmp_path, capsys)
    row = _row(status, "sweep/3")
    assert "wrong type for" in row
    for key in ("final_eval_loss", "seed", "skipped_steps", "steps", "strategy", "fingerprint"):
        assert key in row
    runs = load_runs(root).runs.set_index("run_id")
    assert runs.loc["sweep/3", "strategy"] == "max_ema"  # the list fell back to Hydra's override
    assert runs.loc["sweep/3", "seed"] == 0
    assert pd.isna(runs.loc["sweep/3", "final_eval_loss"])
    _still_compares(md)


def test_wrong_types_in_metrics_lines(tmp_path, capsys):
    root = _sweep(tmp_path)
    path = root / "0" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0].update(loss={"a": 1}, scale="65536", act_zero_frac=[0.1], scales={"x": 1},
                    scale_groups="fc1", act_exp_hist={"lo": "x", "counts": 3}, skipped="no")
    lines[1]["act_zero_frac"] = {"fc1": {"nested": 1}, "fc2": "0.5", "head": 0.1}
    lines.insert(2, {"kind": "train", "step": "10"})
    lines.insert(3, {"kind": ["train"], "step": 1})
    lines.insert(4, [1, 2])
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    md, status = _report(root, tmp_path, capsys)
    row = _row(status, "sweep/0")
    assert "step is not an integer" in row
    rs = load_runs(root)
    assert any("not a JSON object (list)" in p for p in rs.problems)
    issues = rs.runs.set_index("run_id").loc["sweep/0", "issues"]
    for key in ("loss", "scale", "act_zero_frac ×2", "act_exp_hist"):
        assert key in issues
    first = rs.train[rs.train["run_id"] == "sweep/0"].iloc[0]
    assert pd.isna(first["loss"]) and pd.isna(first["scale"])
    _still_compares(md)


HOSTILE = ["$\\foo$", "unbalanced $ sign", "<script>alert(1)</script>", "a|b`c**d**\nnext"]


@pytest.mark.parametrize("text", HOSTILE)
def test_tex_html_and_markup_in_strings(tmp_path, capsys, text):
    root = _sweep(tmp_path)
    for job in ("0", "1", "2"):  # every native run, so the name reaches tables and figures
        s = _summary(root / job)
        s["strategy"] = f"native {text}"
        s["workload"] = f"mlp/{text}"
        (root / job / "summary.json").write_text(json.dumps(s))
    s = _summary(root / "3")
    s.update(status="failed", error=text)
    (root / "3" / "summary.json").write_text(json.dumps(s))
    path = root / "4" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for ln in lines:
        if ln["kind"] == "train":
            ln["act_zero_frac"] = {text: 0.1, "fc2": 0.2}
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    md, status = _report(root, tmp_path, capsys)
    html = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in html and "<script" not in html.split("</style>", 1)[1]
    assert "**failed**" in _row(status, "sweep/3")
    for line in md.splitlines():  # every untrusted string sits inside a code span
        if "alert(1)" in line or "\\foo" in line:
            outside = "".join(line.split("`")[::2])
            assert "<script>" not in outside and "\\foo" not in outside, line


def test_huge_and_non_finite_values(tmp_path, capsys):
    root = _sweep(tmp_path)
    for job, value in (("3", 1e308), ("4", float("inf")), ("5", -1e308)):
        s = _summary(root / job)
        s.update(final_eval_loss=value, skipped_steps=10**30, strategy_overhead_frac=value)
        (root / job / "summary.json").write_text(json.dumps(s))
    path = root / "0" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for ln in lines:
        if ln["kind"] == "train":
            ln.update(loss=1e308, scale=float("inf"), loss_avg=float("nan"), step=ln["step"])
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    md, status = _report(root, tmp_path, capsys)
    assert "inf" in md
    drawn = {p.name.split("-")[0] for p in (tmp_path / "out" / "figures").glob("*.png")}
    assert {"loss", "scales", "skipped", "underflow", "exponents"} <= drawn
    figures = md.split("## Figures", 1)[1]
    for kind in {"loss", "intervals", "paired"} - drawn:  # a figure left out is said, not lost
        assert "Not drawn from these records" in figures, kind


def test_non_utf8_bytes(tmp_path, capsys):
    root = _sweep(tmp_path)
    raw = (root / "0" / "summary.json").read_bytes().replace(b'"native"', b'"nat\xff\xfeive"')
    (root / "0" / "summary.json").write_bytes(raw)
    with (root / "1" / "metrics.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "train", "step": 99, "loss": "\xc3\x28"}\n\xff\xfe\n')
    (root / "2" / ".hydra" / "overrides.yaml").write_bytes(b"- strategy=\xff\n")
    md, status = _report(root, tmp_path, capsys)
    assert "corrupt line skipped" in _row(status, "sweep/1")


def test_unknown_status_counts_as_not_completed(tmp_path, capsys):
    root = _sweep(tmp_path)
    s = _summary(root / "4")
    s.update(status="stalled", error="stopped after 50 consecutive skipped steps")
    (root / "4" / "summary.json").write_text(json.dumps(s))
    md, status = _report(root, tmp_path, capsys)
    assert "**stalled**" in _row(status, "sweep/4")
    assert "| stalled |" in status.replace("`", "")  # a column of the counts table
    res = pd.read_csv(tmp_path / "out" / "results.csv").set_index(["precision", "strategy"])
    assert res.loc[("fp16", "max_ema"), "n_completed"] == 2
    assert res.loc[("fp16", "max_ema"), "n_other"] == 1


def test_analysis_imports_only_the_schema_of_experiments():
    code = ("import sys, analysis, analysis.load, analysis.report, analysis.figures, "
            "analysis.tables, analysis.verdict, analysis.wandb_runs, analysis.paired\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'strategies', 'cuda', 'hydra', 'omegaconf') or "
            "(m.startswith('experiments') and m not in ('experiments', 'experiments.schema')))\n"
            "print(bad)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
