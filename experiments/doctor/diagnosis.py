"""Automatic diagnosis: when a run stalls, diverges or hits the scale floor, the training app asks
the doctor (``strategies.doctor``) why, on the failing step's own batch, and writes the verdict to
``<run dir>/diagnosis.json``.

:func:`diagnose_run` is the one call the loop makes; it decides itself whether to run (status
``diverged`` or ``stalled``, or a :class:`strategies.state.ScaleFloorError`, i.e.
``on_min_scale: raise``), never raises (a doctor that fails writes its one-line error instead,
so a diagnosis can never hide the run's own result) and returns the :class:`Diagnosis` or
``None``. :func:`annotate` then appends the verdict's one line to the run's stop message, so
``summary.json``'s ``error`` says why as well as what (and its ``diagnosis`` key holds the cause). Cost: the doctor's passes on one batch (two forward+backward, plus one backward per
compared strategy), once per failed run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from experiments.app.build import one_line
from experiments.app.records import check, write_json_atomic
from experiments.schema import DIAGNOSIS_FIELDS, DIAGNOSIS_NAME
from strategies.doctor import DTYPES, Diagnosis, diagnose
from strategies.state import ScaleFloorError

__all__ = ["DIAGNOSIS_NAME", "TRIGGERS", "LR_WINDOW", "annotate", "diagnose_run", "doctor_precision", "should_diagnose"]

TRIGGERS = ("diverged", "stalled")
LR_WINDOW = 20
"""Steps of the learning-rate schedule the doctor sees, the failing step last."""


def at_floor(error: BaseException | str | None) -> bool:
    """A strategy ended the run at its scale floor: the exception, or the loop's one-line error
    ``"ScaleFloorError: ..."``."""
    return isinstance(error, ScaleFloorError) or (
        isinstance(error, str) and error.startswith(f"{ScaleFloorError.__name__}:"))


def should_diagnose(status: str, error: BaseException | str | None = None) -> bool:
    """A stalled or diverged run, or one a strategy ended at its scale floor (:func:`at_floor`)."""
    return status in TRIGGERS or at_floor(error)


def annotate(status: str, error: str | None, diag: Diagnosis | None) -> str | None:
    """The run's one-line stop message with the doctor's verdict appended:
    ``"<error>; doctor: <cause> at <module>: <verdict>; fix: <fix>"`` (:meth:`Diagnosis.one_line`).

    ``error`` unchanged when there is no diagnosis or the run is not one the doctor diagnoses
    (:func:`should_diagnose`); the verdict alone when the run stopped without a message.
    """
    if diag is None or not should_diagnose(status, error):
        return error
    verdict = one_line(diag.one_line())
    return f"{error}; {verdict}" if error else verdict


def doctor_precision(precision: Any) -> tuple[str, dict | None]:
    """The doctor's ``precision`` and ``blocks`` for a run's precision (a name or a
    :class:`experiments.workloads.precision.Precision`): a block-scaled mode is diagnosed in its
    autocast dtype, with each role's row-wise recipe for the block-clipping measurement."""
    name = str(getattr(precision, "name", precision))
    spec = getattr(precision, "blocks", None)
    if spec is None:
        return name, None
    autocast = {dtype: key for key, dtype in DTYPES.items()}.get(precision.autocast, name)
    return autocast, dict(spec.rowwise)


def _write(path: Path, record: dict[str, Any]) -> None:
    write_json_atomic(path, check(DIAGNOSIS_FIELDS, record))


def diagnose_run(
    run_dir: str | Path,
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: dict[str, Any],
    precision: Any,
    scaler: Any,
    lr_for: Callable[[int], float],
    step: int,
    status: str,
    error: BaseException | str | None = None,
) -> Diagnosis | None:
    """Diagnose the failing step and write ``diagnosis.json`` (see the module docstring).

    Args:
        model: the unwrapped model (strategy hooks detached), at the failing step's weights.
        loss_fn: the loop's ``loss_fn(logits, y)``; the doctor differentiates
            ``loss_fn(model(x), y) * m`` with the loop's ``batch = {"x", "y", "m"}``.
        precision: the run's precision (its ``name``, or the name itself).
        scaler: the strategy (its current scale is the one diagnosed).
        lr_for: the learning-rate schedule ``step -> lr``.
    """
    if not should_diagnose(status, error) or not batch:
        return None
    path = Path(run_dir) / DIAGNOSIS_NAME
    name, blocks = doctor_precision(precision)
    record: dict[str, Any] = {"status": status, "step": step}
    if name not in DTYPES:
        _write(path, {**record, "error": f"the doctor diagnoses {', '.join(DTYPES)} runs, not {name}"})
        return None
    enabled = bool(getattr(scaler, "is_enabled", lambda: True)())
    # A strategy's floor error is raised in step(), before the loop clears .grad: the failing
    # step's own gradients are set aside, so the doctor does not take them for accumulated ones.
    grads = [(p, p.grad) for p in model.parameters()] if at_floor(error) else []
    for p, _ in grads:
        p.grad = None
    try:
        diagnosis = diagnose(
            model, lambda m, b: loss_fn(m(b["x"]), b["y"]) * b["m"], batch, precision=name,
            scaler=scaler if enabled else None, scale=None if enabled else 1.0,
            lr_history=[lr_for(s) for s in range(max(1, step - LR_WINDOW + 1), step + 1)], blocks=blocks,
        )
    except Exception as exc:  # noqa: BLE001 - the run's own result must survive a failing doctor
        _write(path, {**record, "error": one_line(f"{type(exc).__name__}: {exc}")[:500]})
        return None
    finally:
        for p, g in grads:
            p.grad = g
    _write(path, {**record, **diagnosis.to_dict()})  # non-finite numbers as NaN/Infinity, as every record
    return diagnosis
