"""The run-record schema as written: docs/run-records.md lists exactly the schema's fields, the
writers refuse keys the schema does not know, and telemetry is flattened without strategy names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import strategies
from experiments.app import records, telemetry
from experiments import schema
from experiments.app.train import CONF_DIR
from tests.experiments.runs import DOC, documented

EXPERIMENTS = CONF_DIR.parent / "experiments"


@pytest.mark.parametrize(
    "fields,start,end",
    [
        (schema.TRAIN_FIELDS, '`kind: "train"`', '`kind: "eval"`'),
        (schema.EVAL_FIELDS, '`kind: "eval"`', '`kind: "fidelity"`'),
        (schema.FIDELITY_FIELDS, '`kind: "fidelity"`', "## `summary.json`"),
        (schema.SUMMARY_FIELDS, "## `summary.json`", "## Other files"),
        (schema.TRACE_HEADER_FIELDS, '`kind: "trace_header"`', '`kind: "trace"` —'),
        (schema.TRACE_FIELDS, '`kind: "trace"` —', "Row columns"),
        (schema.REPLAY_FIELDS, "## `replay.json`", "Each row of `presets`"),
        (schema.REPLAY_ROW_FIELDS, "Each row of `presets`", "## Loggers"),
    ],
)
def test_documented_keys_are_the_schemas_fields(fields: dict, start: str, end: str) -> None:
    assert documented(start, end) == set(fields)


def test_documented_trace_columns_are_the_schemas_in_order() -> None:
    text = DOC.read_text()
    para = text[text.index("Row columns"):text.index("Size:", text.index("Row columns"))]
    named = [n for n in schema.TRACE_COLUMNS if "<" not in n]
    assert [n for n in re.findall(r"`([a-z_]+)`", para) if n in named] == named


def test_documented_statuses_and_file_names_are_the_schemas() -> None:
    text = DOC.read_text()
    status_row = next(line for line in text.splitlines() if line.startswith("| `status` |"))
    assert all(f"`{s}`" in status_row for s in schema.STATUSES)
    for name in (schema.METRICS_NAME, schema.SUMMARY_NAME, schema.CHECKPOINT_NAME, schema.LOCK_NAME, schema.TRACE_NAME,
                 schema.REPLAY_NAME):
        assert f"`{name}`" in text


def test_writers_refuse_keys_the_schema_does_not_know(tmp_path: Path) -> None:
    writer = records.MetricsWriter(tmp_path / schema.METRICS_NAME)
    writer.write({"kind": "eval", "step": 1, "eval_loss": 2.0})
    with pytest.raises(KeyError, match=r"unknown keys \['loss_scale'\]"):
        writer.write({"kind": "eval", "step": 2, "eval_loss": 2.0, "loss_scale": 1.0})
    with pytest.raises(KeyError, match=r"missing \['eval_loss'\]"):
        writer.write({"kind": "eval", "step": 3})
    writer.close()
    assert records.read_metrics(tmp_path / schema.METRICS_NAME) == [{"kind": "eval", "step": 1, "eval_loss": 2.0}]
    with pytest.raises(KeyError, match="missing"):
        records.write_summary(tmp_path / schema.SUMMARY_NAME, {"status": "completed"})
    assert not (tmp_path / schema.SUMMARY_NAME).exists()


def test_telemetry_is_flattened_generically() -> None:
    tel = {
        "scale": torch.tensor(1024.0),
        "growth_tracker": torch.tensor(3, dtype=torch.int32),
        "found_inf": torch.tensor(0.0),
        "grad_absmax": torch.tensor(2.0),
        "grad_norm": torch.tensor(3.0),
        "grad_zero_frac": torch.tensor(0.25),
        "grad_subnormal_frac": torch.tensor(0.5),
        "scales": torch.tensor([8.0, 16.0, 32.0]),
        "group_ema": torch.tensor([1.0, 2.0, 3.0]),
        "probe_time_s": torch.tensor(0.125),
        "brand_new_rule_state": torch.tensor([[1.0, 2.0]]),
    }
    own = dict.fromkeys(telemetry.GRAD_FIELDS, -1.0)
    out = telemetry.flatten(tel, ["embed", "blocks.0", "head"], own)
    assert out == {
        "scale": 1024.0, "grad_absmax": 2.0, "grad_norm": 3.0, "grad_zero_frac": 0.25, "grad_subnormal_frac": 0.5,
        "scales": [8.0, 16.0, 32.0], "scale_groups": ["embed", "blocks.0", "head"], "probe_time_s": 0.125,
        "telemetry": {"growth_tracker": 3, "found_inf": 0.0, "group_ema": [1.0, 2.0, 3.0],
                      "brand_new_rule_state": [[1.0, 2.0]]},
    }
    assert json.loads(json.dumps(out)) == out
    # Scaling off (no telemetry): scale 1 and the loop's own gradient measurement.
    assert telemetry.flatten({}, ["all"], own) == {"scale": 1.0, **own}


def test_the_loop_knows_no_strategy_by_name() -> None:
    source = "".join((EXPERIMENTS / "app" / name).read_text() for name in ("loop.py", "step.py", "telemetry.py"))
    literals = set(re.findall(r"[\"']([A-Za-z_]+)[\"']", source))
    assert not literals & set(strategies.available())
    assert not literals & {"ema", "candidate", "probe_time_s", "group_names", "hysteresis_tracker"}


def test_every_source_file_is_at_most_400_lines() -> None:
    sizes = {str(p): len(p.read_text().splitlines()) for p in EXPERIMENTS.rglob("*.py")}
    assert max(sizes.values()) <= 400, sizes
