"""Why a run ends early: the ``summary.json`` status and one-line ``error`` of each case.

Each function returns ``(status, error)`` when the run must stop, else ``None`` (statuses:
``experiments/schema.py`` ``STATUSES``; what each means: ``docs/run-records.md``).

* **diverged**: a logged training loss that is non-finite or above ``train.divergence_loss``, or a
  non-finite evaluation loss.
* **stalled**: the run makes no progress. Either ``train.max_consecutive_skips`` steps in a row
  were skipped with a finite loss (the loss scale collapsed: every scaled gradient overflows), or
  the loss itself was non-finite on a skipped step — a **forward overflow**: the loss is computed
  in fp32 from the forward's logits before any scaling, so the scale S neither causes nor cures
  it (every gradient of a non-finite loss is non-finite, at any S). A non-finite logged loss when
  no step was ever applied (every step skipped: the weights are the initial ones) is the same
  forward overflow, not a divergence. When that step's inputs themselves hold NaN/Inf, the
  error says **non-finite inputs** instead: the data, not the forward's range, is at fault.
* **requeued**: the job was stopped by its preemption signal and requeued (``experiments/app/
  preemption.py``); it resumes from its last checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from experiments.app.build import one_line

__all__ = ["Stop", "eval_loss", "exception", "forward_overflow", "inputs_finite", "logged_loss", "skipped_in_a_row"]

Stop = tuple[str, str]
"""``(status, one-line error)`` of a run that must stop."""


def inputs_finite(batch: Mapping[str, Any] | None) -> bool:
    """Whether every floating-point tensor of the step's ``batch`` is finite (one read, at a stop)."""
    tensors = [t for t in (batch or {}).values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def forward_overflow(loss: float, step: int, skipped: int, precision: str, batch: Mapping[str, Any] | None = None) -> Stop:
    """``stalled``: the loss is non-finite before scaling at ``step`` (see the module docstring);
    ``batch``: that step's inputs, which tell a forward overflow from non-finite data."""
    where = f"({loss} at step {step}, the last of {skipped} skipped steps in a row), so no loss scale can help"
    if not inputs_finite(batch):
        return ("stalled", f"non-finite inputs: the loss is non-finite before scaling {where}: the batch of step "
                f"{step} holds NaN/Inf (check the data pipeline; scalelab-doctor names it)")
    return ("stalled", f"forward overflow: the loss is non-finite before scaling {where}: the forward pass overflows "
            f"in {precision} (smaller inputs, activations or model.init_scale; or bf16 or fp32)")


def logged_loss(loss: float, step: int, skipped_total: int, limit: float, precision: str,
                batch: Mapping[str, Any] | None = None) -> Stop | None:
    """The stop for the training loss logged at ``step``, ``skipped_total`` steps skipped so far."""
    if not math.isfinite(loss) and skipped_total == step:  # no step ever applied
        return forward_overflow(loss, step, step, precision, batch)
    if not math.isfinite(loss) or loss > limit:
        return "diverged", f"training loss {loss} at step {step} is non-finite or above train.divergence_loss={limit}"
    return None


def eval_loss(loss: float, step: int) -> Stop | None:
    return None if math.isfinite(loss) else ("diverged", f"eval loss is non-finite at step {step}")


def skipped_in_a_row(loss: float, step: int, skips: int, scale: float, precision: str,
                     batch: Mapping[str, Any] | None = None) -> Stop:
    """``stalled`` after ``skips`` skipped steps in a row ending at ``step`` (``loss``: this step's)."""
    if not math.isfinite(loss):
        return forward_overflow(loss, step, skips, precision, batch)
    return ("stalled", f"the strategy skipped {skips} steps in a row (steps {step - skips + 1}-{step}, non-finite "
            f"gradients; scale now {scale:.3g}): the loss scale has collapsed (train.max_consecutive_skips)")


def exception(exc: BaseException, requeued_by: str | None, step: int, resume_step: int) -> Stop:
    """How a run that raised ``exc`` at ``step`` ended: ``requeued`` for the ``SystemExit`` of
    submitit's handler after it requeued the job (``requeued_by``: the signal's name, from
    :class:`experiments.app.preemption.RequeueWatch`), else ``failed`` with the exception in one line."""
    if requeued_by is not None and isinstance(exc, SystemExit):
        return ("requeued", f"{requeued_by} at step {step} (preemption or time limit): submitit requeued the job, "
                f"which resumes from step {resume_step}")
    return "failed", one_line(f"{type(exc).__name__}: {exc}")
