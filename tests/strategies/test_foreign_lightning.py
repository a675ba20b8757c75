"""Every strategy (presets included) as the scaler of Lightning's ``MixedPrecision("16-mixed")``
plugin on the CPU: it trains, a step with an Inf gradient is skipped with the rule's reaction,
and a checkpoint (the plugin saves ``scaler.state_dict()``) resumes into a fresh strategy.

Lightning's path (``lightning/pytorch/plugins/precision/amp.py``): ``pre_backward`` scales the
loss, ``optimizer_step`` calls ``unscale_`` (unless the optimizer unscales itself), the
gradient-clipping hook (``gradient_clip_val``), ``step`` and ``update``; ``state_dict``/``load_state_dict`` of the plugin
are the scaler's, stored in the checkpoint under the plugin's class name.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_overflow_reaction, fp16_safe, make_strategy, strategy_cases

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

INJECT = 2  # the batch whose gradients are poisoned with Inf
STEPS, RESUMED_STEPS = 4, 6


class Tiny(L.LightningModule):
    """Two linear layers (two layer groups for the per-layer rules); records, per batch, whether
    the parameters moved and the scale before and after the step."""

    def __init__(self, scaler, inject: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.act, self.l2 = torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        self.scaler, self.inject, self.rows, self.at_start = scaler, inject, {}, None
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.act(self.l1(x)))

    def reference_loss(self) -> torch.Tensor:  # the fp32 reference of norm_ratio / hybrid
        x, y = self.current
        return F.mse_loss(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        self.current = batch
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.current_batch == self.inject:
            self.l2.weight.grad.fill_(math.inf)

    def on_train_start(self) -> None:
        self.at_start = self.scaler.state_dict()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.current_batch = self.trainer.fit_loop.total_batch_idx
        self.before = [p.detach().clone() for p in self.parameters()], self.scaler.get_scale()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        params, scale = self.before
        moved = not all(torch.equal(p, q) for p, q in zip(self.parameters(), params))
        self.rows[self.current_batch] = (moved, scale, self.scaler.get_scale())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * RESUMED_STEPS, 8, generator=g),
                                          torch.randn(8 * RESUMED_STEPS, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def fit(name: str, kw: dict, max_steps: int, inject: int | None = None, ckpt: Path | None = None):
    module = Tiny(None, inject)
    module.scaler = make_strategy(name, fp16_safe(kw), module, module.reference_loss)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, gradient_clip_val=1.0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=module.scaler)])
    trainer.fit(module, loader(), ckpt_path=ckpt)
    return trainer, module


@pytest.mark.parametrize("name,kw", strategy_cases())
def test_lightning_16_mixed_skips_an_inf_step_and_resumes_the_scaler_state(name: str, kw: dict,
                                                                          tmp_path: Path) -> None:
    trainer, module = fit(name, kw, STEPS, inject=INJECT)
    s = module.scaler
    assert sorted(module.rows) == list(range(STEPS))
    if not s.is_enabled():  # "none": a disabled scaler is transparent, as GradScaler(enabled=False)
        assert all(moved and before == after == 1.0 for moved, before, after in module.rows.values())
    else:
        for batch, (moved, before, after) in module.rows.items():
            assert moved == (batch != INJECT), batch
            assert math.isfinite(after) and after > 0
        _, before, after = module.rows[INJECT]
        assert_overflow_reaction(s, after, before)
        assert s.telemetry()["skipped_steps"].item() == 1
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False).get("MixedPrecision", {})  # absent when it is empty
    assert saved == s.state_dict()

    _, resumed = fit(name, kw, RESUMED_STEPS, ckpt=path)
    assert resumed.at_start == saved  # restored before training went on
    assert sorted(resumed.rows) == list(range(STEPS, RESUMED_STEPS))
    assert all(moved for moved, _, _ in resumed.rows.values())  # training continues
    if s.is_enabled():
        assert resumed.scaler.updates == s.updates + RESUMED_STEPS - STEPS
