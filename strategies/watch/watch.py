"""The early warning and the trace in any training loop: :class:`Watch`.

>>> watch = Watch(scaler, model, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
>>> for step, batch in enumerate(loader, 1):
...     loss = loss_fn(model, batch); scaler.scale(loss).backward()
...     scaler.unscale_(optimizer); watch.unscaled()          # optional: per-layer-group abs-max
...     scaler.step(optimizer); scaler.update()
...     watch.step(loss, lr=optimizer.param_groups[0]["lr"], batch=batch)
...     optimizer.zero_grad()
>>> watch.replay(strategies.create("native", init_scale=2.0**32, hysteresis=2))  # Megatron's, so far

Each step's row goes to a :class:`strategies.tracing.TraceRecorder` on the device — with the
forward activation abs-max, from forward hooks :class:`Watch` installs on the model's leaf modules
(``activations=False``: none; :meth:`close` takes them off) — and every
``every`` steps the rows are read once and fed to the :class:`strategies.watch.detector.Detector`.
At the first alarm the warning is logged (``log``; default: the ``scalelab.watch`` logger), and — when ``loss_fn`` and the step's batch are known — the doctor
(:func:`strategies.doctor.diagnose`) re-runs that batch and the line ends with its verdict:
``"scalelab watch: step 96: scale heading for its floor (5 halvings below its peak); doctor says:
forward overflow at blocks.0.scores"``. The doctor runs only when the warning fires (importing this
module loads its library, ``strategies.doctor``; ``import strategies`` does not).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from strategies import doctor
from strategies.tracing import Trace, TraceRecorder, replay
from strategies.tracing.replay import ReplayResult
from strategies.watch.detector import Detector, observations

__all__ = ["FORWARD_DTYPES", "Watch", "doctor_words"]

FORWARD_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The forward's dtype of each ``precision`` (the activations hooked)."""


def doctor_words(diagnosis: Any) -> str:
    """``"forward overflow at blocks.0.scores"`` from a :class:`strategies.doctor.Diagnosis`; a step
    the doctor finds healthy (a warning from a precursor, such as the forward headroom, comes before
    the fault) reads ``"no fault in this step yet"``."""
    if diagnosis.cause == "healthy":
        return "no fault in this step yet"
    where = f" at {diagnosis.first_module}" if getattr(diagnosis, "first_module", None) else ""
    return f"{diagnosis.cause.replace('_', ' ')}{where}"


class Watch:
    """Trace and early warning around a loop's scaler (module docstring).

    Args:
        scaler: the loop's :class:`strategies.Strategy` (a plain GradScaler is traced as scale 1).
        model: the trained model (layer groups; the doctor's model).
        precision: ``"fp16"`` or ``"bf16"``: the autocast the doctor re-runs and the format of the trace.
        loss_fn: ``loss_fn(model, batch) -> loss`` for the doctor (None: no doctor).
        every: steps between reads of the device (and detector updates).
        log: where the warning line goes (default: the ``scalelab.watch`` logger, at WARNING).
        detector: a :class:`Detector` (default: the fitted one).
        activations: hook the model's leaf modules for the forward activation abs-max in the
            ``precision``'s dtype (the detector's ``act_fill``/``act_growth``; needs ``model``).
    """

    def __init__(self, scaler: Any, model: torch.nn.Module | None = None, *, precision: str = "fp16",
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None, every: int = 10,
                 log: Callable[[str], None] | None = None, detector: Detector | None = None,
                 activations: bool = True) -> None:
        self.scaler, self.model, self.precision, self.loss_fn = scaler, model, precision, loss_fn
        self.every, self.log = every, log or logging.getLogger("scalelab.watch").warning
        forward = FORWARD_DTYPES.get(precision) if activations else None
        self.recorder = TraceRecorder(scaler, model, format=precision, keep=True, forward=forward)
        self.detector = detector or Detector()
        self.steps = 0
        self._seen = 0
        self.warning: str | None = None
        self.diagnosis: Any = None

    def unscaled(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """After ``unscale_`` (optional): the per-layer-group abs-max of the unscaled gradients."""
        if params is None and self.model is None:
            return
        self.recorder.unscaled(params if params is not None else self.model.parameters())

    def step(self, loss: torch.Tensor | float, lr: float = 0.0, batch: Any = None) -> str | None:
        """After ``update()``: record the step; every ``every`` steps read the rows and update the
        detector. Returns the warning line the first time the detector fires (else None)."""
        self.steps += 1
        self.recorder.stepped(self.steps, loss, lr)
        if self.steps % self.every:
            return None
        return self.check(batch)

    def check(self, batch: Any = None) -> str | None:
        """Read the rows recorded so far and feed the detector (one host read); on the first alarm
        run the doctor on ``batch`` and log the warning."""
        trace = self.recorder.trace()
        fresh = observations(trace)[self._seen:]
        self._seen += len(fresh)
        for obs in fresh:
            self.detector.update(obs)
            if self.detector.alarm_step is not None and self.warning is None:
                self.warning = self._warn(obs.step, batch)
                return self.warning
        return None

    def _warn(self, step: int, batch: Any) -> str:
        line = f"scalelab watch: step {step}: {self.detector.reason()}"
        if self.loss_fn is not None and batch is not None and self.model is not None:
            line += f"; doctor says: {self._doctor(batch)}"
        self.log(line)
        return line

    def _doctor(self, batch: Any) -> str:
        """The doctor on ``batch`` at the current weights and scale; the step's gradients (still in
        ``.grad`` before the loop's ``zero_grad``) are set aside meanwhile, so that it does not read
        them as gradients never cleared, and put back after; what the forward hooks saw of its
        re-runs is dropped."""
        held = {p: p.grad for p in self.model.parameters()}
        for p in held:
            p.grad = None
        try:
            self.diagnosis = doctor.diagnose(self.model, self.loss_fn, batch, self.precision, self.scaler,
                                             compare_strategies=False)
        except Exception as exc:  # noqa: BLE001 - a warning must not end the user's training
            return f"could not run ({type(exc).__name__}: {exc})"
        finally:
            for p, g in held.items():
                p.grad = g
            if self.recorder.forward is not None:  # the doctor's own forwards are not the next step's
                self.recorder.forward.reset()
        return doctor_words(self.diagnosis)

    def close(self) -> None:
        """Take the forward hooks off the model (the trace so far stays readable)."""
        self.recorder.remove()

    def trace(self) -> Trace:
        """Every step recorded so far."""
        return self.recorder.trace()

    def replay(self, strategy: Any, **kw: Any) -> ReplayResult:
        """What ``strategy`` (a fresh Strategy or a registered rule's name) would have done so far."""
        return replay(self.trace(), strategy, **kw)

    def save(self, path: str | Path) -> Path:
        """Write the trace as ``trace.jsonl`` (``scalelab-replay PATH --strategy NAME`` reads it)."""
        path = Path(path)
        path.write_text("".join(line + "\n" for line in self.trace().lines()), encoding="utf-8")
        return path
