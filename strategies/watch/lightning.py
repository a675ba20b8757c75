"""The early warning as a Lightning callback: ``Trainer(callbacks=[lightning_callback()])``.

It finds the scaler of Lightning's ``MixedPrecision`` plugin (``trainer.precision_plugin.scaler``:
a :class:`strategies.Strategy` passed as ``MixedPrecision(..., scaler=strategy)``, or Lightning's own
GradScaler, traced at scale 1 then), and drives a :class:`strategies.watch.Watch`: the per-group
abs-max in ``on_before_optimizer_step`` (the plugin has unscaled the gradients there, before
clipping), one row per ``on_train_batch_end``. The doctor's loss is the module's own
``training_step`` unless ``loss_fn`` is given. Lightning is imported when this function is called
(an optional dependency).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from strategies.watch.watch import Watch

__all__ = ["lightning_callback", "training_step_loss"]


def training_step_loss(module: Any, batch: Any) -> Any:
    """The loss a LightningModule's ``training_step`` returns (a tensor, or a dict's ``"loss"``)."""
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def lightning_callback(scaler: Any = None, *, loss_fn: Callable[[Any, Any], Any] | None = training_step_loss,
                       precision: str = "fp16", every: int = 10, log: Callable[[str], None] | None = None) -> Any:
    """A ``lightning.pytorch.Callback`` that traces the run and warns (module docstring); its
    :class:`Watch` is ``callback.watch`` once training started (``callback.watch.replay(...)``)."""
    import lightning.pytorch as pl  # optional dependency: imported only by its users

    log = log or logging.getLogger("scalelab.watch").warning

    class ScaleWatch(pl.Callback):
        watch: Watch | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            s = scaler if scaler is not None else getattr(trainer.precision_plugin, "scaler", None)
            self.watch = Watch(s, pl_module, precision=precision, loss_fn=loss_fn, every=every, log=log)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.watch.unscaled(pl_module.parameters())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if loss is None:
                return
            self.watch.step(loss.detach(), trainer.optimizers[0].param_groups[0]["lr"], batch)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.watch.close()  # the forward hooks off the model

    return ScaleWatch()
