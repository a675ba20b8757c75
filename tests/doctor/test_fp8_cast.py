"""Issue 21's fp8 workload where per-tensor casting matters (conf/experiment/doctor_fp8_cast.yaml):
a real fp8-E4M3 GPT run with no loss scale loses most of its gradient at the casts without cast
scaling, and keeps it with TransformerEngine's per-tensor current scaling — measured by the app's
fidelity probe against the fp32 gradient at the same weights and batch, and in the loss."""

from __future__ import annotations

from pathlib import Path

from tests.experiments.runs import run_tiny

RUN = ("+experiment=doctor_fp8_cast", "train.eval_every=0", "train.checkpoint_every=0")


def test_per_tensor_current_scaling_keeps_the_gradients_that_none_loses(tmp_path: Path) -> None:
    lost, _ = run_tiny(tmp_path / "none", *RUN, "precision.cast_scaling=none", model="gpt")
    kept, _ = run_tiny(tmp_path / "current", *RUN, "precision.cast_scaling=current", model="gpt")
    assert lost["precision"] == kept["precision"] == "fp8_e4m3" and lost["strategy"] == "none"
    assert lost["fidelity_lost_frac_mean"] > 0.5 and lost["fidelity_one_minus_cos_mean"] > 0.3
    assert kept["fidelity_lost_frac_mean"] < 0.01 and kept["fidelity_one_minus_cos_mean"] < 0.01
    assert lost["final_train_loss"] > kept["final_train_loss"] + 0.5  # the lost gradient costs training
