"""Issue 21's "gradients not cleared" workload as an app option: ``train.zero_grad=false`` makes
the optimizer's ``zero_grad()`` a no-op (``experiments.app.build.keep_gradients``), a loop bug on
purpose; in a real fp16 run the first overflow stays in ``.grad``, the scale collapses, and the
doctor names ``grads_not_cleared``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from experiments.app.build import ConfigError, build_optimizer
from experiments.app.config import RunConfig
from experiments.schema import DIAGNOSIS_NAME
from tests.experiments.runs import compose_cfg, run_tiny


def _grads_after_two_steps(zero_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = compose_cfg("model=mlp", "data=vectors", "logger=none", f"train.zero_grad={str(zero_grad).lower()}")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3))
    opt = build_optimizer(cfg, [w])
    x1, x2 = torch.randn(3), torch.randn(3)
    (w * x1).sum().backward()
    opt.zero_grad(set_to_none=True)
    (w * x2).sum().backward()
    return w.grad, x1, x2


def test_zero_grad_false_accumulates_as_a_loop_without_it() -> None:
    """Reference: d/dw sum(w*x) = x; without clearing, .grad is x1 + x2 (torch's accumulation)."""
    grad, x1, x2 = _grads_after_two_steps(zero_grad=False)
    torch.testing.assert_close(grad, x1 + x2, rtol=0, atol=0)
    grad, _, x2 = _grads_after_two_steps(zero_grad=True)
    torch.testing.assert_close(grad, x2, rtol=0, atol=0)


def test_zero_grad_must_be_true_or_false() -> None:
    cfg = compose_cfg("logger=none")
    assert cfg.train.zero_grad is True  # the default: a correct loop
    with open_dict(cfg):
        cfg.train.zero_grad = "sometimes"
    with pytest.raises(ConfigError, match=r"^train.zero_grad must be true or false, got 'sometimes'$"):
        RunConfig.from_hydra(cfg)


RUN = ("+experiment=doctor_grads_not_cleared", "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=0")


def test_an_overflow_kept_in_grad_collapses_the_scale_and_the_doctor_says_why(tmp_path: Path) -> None:
    """fp16 MLP, native scaler started at 2^21 (about 5x over the safe scale): with zero_grad the
    first steps overflow, the scaler backs off and the run completes; without it the first
    overflow's inf never leaves .grad, every step is skipped and the run stalls at the floor."""
    ok, _ = run_tiny(tmp_path / "ok", *RUN, "train.zero_grad=true")
    assert ok["status"] == "completed" and 0 < ok["skipped_steps"] < 10
    assert not (tmp_path / "ok" / DIAGNOSIS_NAME).exists()
    bug, rows = run_tiny(tmp_path / "bug", *RUN)
    assert bug["status"] == "stalled" and bug["skipped_steps"] == 20 and all(r["skipped"] for r in rows if r["kind"] == "train")
    diag = json.loads((tmp_path / "bug" / DIAGNOSIS_NAME).read_text())
    assert diag["cause"] == "grads_not_cleared" and "non-finite gradients before this step" in diag["evidence"][0]
