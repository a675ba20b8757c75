"""The early warning as a Hugging Face ``TrainerCallback``: ``trainer.add_callback(hf_callback(trainer))``.

The scaler is ``trainer.accelerator.scaler`` (a :class:`strategies.Strategy` set there before
``train()``, as on a GPU; none: traced at scale 1). The Trainer hands its callbacks neither the
loss nor the batch, so a forward hook on the model keeps the last training forward's ``loss``
(``outputs.loss``: an HF model given labels) and its inputs (the doctor's batch). Per step: the
per-group abs-max in ``on_pre_optimizer_step`` (after the Trainer's clipping, which unscaled the
gradients: the abs-max is of the clipped gradients there), one row at ``on_step_end``.
``transformers`` is imported when this function is called (an optional dependency).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from strategies.watch.watch import Watch

__all__ = ["hf_callback", "model_loss"]


def model_loss(model: Any, batch: Any) -> Any:
    """The loss of an HF model on a batch of keyword inputs (labels included)."""
    return model(**batch).loss


def hf_callback(trainer: Any = None, *, scaler: Any = None, loss_fn: Callable[[Any, Any], Any] | None = model_loss,
                precision: str = "fp16", every: int = 10, log: Callable[[str], None] | None = None) -> Any:
    """A ``transformers.TrainerCallback`` that traces the run and warns (module docstring); its
    :class:`Watch` is ``callback.watch`` once training started."""
    import transformers  # optional dependency: imported only by its users

    log = log or logging.getLogger("scalelab.watch").warning

    class ScaleWatch(transformers.TrainerCallback):
        watch: Watch | None = None

        def __init__(self) -> None:
            self.loss: Any = math.nan
            self.batch: Any = None
            self._hook: Any = None

        def _seen(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
            if module.training and getattr(output, "loss", None) is not None:
                self.loss, self.batch = output.loss.detach(), dict(kwargs)

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            s = scaler if scaler is not None else getattr(getattr(trainer, "accelerator", None), "scaler", None)
            self.watch = Watch(s, model, precision=precision, loss_fn=loss_fn, every=every, log=log)
            self._hook = model.register_forward_hook(self._seen, with_kwargs=True)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.watch.unscaled()

        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
            self.watch.step(self.loss, lr, self.batch)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self._hook is not None:
                self._hook.remove()
            self.watch.check(self.batch)
            self.watch.close()

    return ScaleWatch()
