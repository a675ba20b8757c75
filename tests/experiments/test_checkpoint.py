"""Checkpoints: RNG round trips, atomic writes, weights_only loading, clear errors; metric records."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from experiments.app import checkpoint as ckpt
from experiments.app import records


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], np.random.randn()


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path) -> None:
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.randn()  # leave a cached Gaussian in NumPy's state
    path = tmp_path / "c.pt"
    ckpt.save(path, {"step": 7, "rng": ckpt.capture_rng()})
    expected = _draws()
    _draws()
    ckpt.restore_rng(ckpt.load(path)["rng"])
    assert _draws() == expected
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed away


def test_truncated_checkpoint_is_a_one_line_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "checkpoint.pt"
    ckpt.save(path, {"step": 1, "w": torch.randn(1000)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(path)
    assert str(path) in str(err.value) and "truncated or corrupt" in str(err.value) and "\n" not in str(err.value)


class Gadget:
    """Not a tensor or plain type: weights_only refuses to unpickle it."""


def test_weights_only_refuses_arbitrary_objects(tmp_path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 1, "gadget": Gadget()}, path)
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        ckpt.load(path)
    torch.save({"no_step": 1}, path)
    with pytest.raises(ckpt.CheckpointError, match="no integer 'step'"):
        ckpt.load(path)


def test_truncate_metrics_drops_later_steps_and_torn_lines(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s} for s in (5, 10, 15)] + [{"kind": "eval", "step": 10}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')
    assert records.truncate_metrics(path, 10) == (1, 1)  # (valid lines after step 10, malformed lines)
    assert records.read_metrics(path) == [rows[0], rows[1], rows[3]]


def test_redact_hides_secrets() -> None:
    cfg = {"logger": {"api_key": "abc", "project": "p"}, "x": [{"WANDB_TOKEN": "t"}]}
    assert records.redact(cfg) == {"logger": {"api_key": "***", "project": "p"}, "x": [{"WANDB_TOKEN": "***"}]}
    assert records.redact(["+logger.api_key=abc", "seed=1"]) == ["+logger.api_key=***", "seed=1"]
