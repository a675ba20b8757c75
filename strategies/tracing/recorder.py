"""Record a :class:`strategies.tracing.trace.Trace` in any training loop, without a host read per step.

Use, around a strategy (or a ``GradScaler``-like object with the same ``state``):

>>> rec = TraceRecorder(strategy, model, format="fp16", forward=torch.float16)
>>> # each step: scale, backward, strategy.unscale_(optimizer)
>>> rec.unscaled(model.parameters())      # optional: per-layer-group abs-max of the unscaled grads
>>> # strategy.step(optimizer); strategy.update()
>>> rec.stepped(step, loss, lr)           # one row, written into a device buffer
>>> chunk = rec.flush()                   # at the logging interval: the one host read

Each step's row is assembled from device tensors — the strategy's own statistics of the step
(``GradStats``, what its rule read), its ``found_inf``, the scale the step ran at, the loss, and
with ``forward`` the abs-max of the step's low-precision forward activations and its module
(:class:`strategies.tracing.activations.ForwardAbsMax`: forward hooks on the model's leaf modules) — and
copied into a device buffer that grows if the loop flushes late (never a read). ``flush`` reads the
buffer once and returns a chunk (:func:`strategies.tracing.trace.encode_chunk`), also kept in memory
when ``keep=True`` (:meth:`trace`). Layer groups are those of ``layerwise``
(:func:`strategies.layer_groups.resolve`, tied weights merged); without a model, one group.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch

from strategies import layer_groups
from strategies.tracing.activations import ForwardAbsMax, not_recorded
from strategies.tracing.trace import BASE_COLUMNS, FORMATS, Format, Histogram, Trace, encode_chunk, header_line

__all__ = ["TraceRecorder"]


def _groups(model: torch.nn.Module | None) -> tuple[list[str], dict[int, int]]:
    """Layer-group names and each parameter's group (``layerwise``'s defaults), or one group."""
    if model is None:
        return ["all"], {}
    try:
        with warnings.catch_warnings():  # tied weights merge with a layerwise warning: not ours to give
            warnings.simplefilter("ignore")
            groups, param_group = layer_groups.assign(model, None)
    except ValueError:  # parameters outside every layer: one group
        return ["all"], {}
    return [name for name, _ in groups], param_group


class TraceRecorder:
    """Per-step statistics of a training run on the device, flushed as trace chunks (module docstring).

    Args:
        strategy: the loop's scaler (a :class:`strategies.Strategy`; anything else records scale 1).
        model: the trained model, for the layer groups (None: one group).
        format: the activation-gradient format: a name of :data:`FORMATS` or a :class:`Format`.
        meta: free-form facts stored in the header (strategy, precision, workload, ...).
        keep: also keep every flushed row in memory (:meth:`trace`).
        forward: the forward's low-precision dtype (``torch.float16``/``torch.bfloat16``): hook the
            model's leaf modules and record the step's activation abs-max (None: not recorded).
    """

    def __init__(self, strategy: Any, model: torch.nn.Module | None = None, *, format: str | Format = "fp16",
                 meta: dict[str, Any] | None = None, keep: bool = False, forward: torch.dtype | None = None) -> None:
        self.strategy = strategy
        self.forward = ForwardAbsMax(model, forward) if forward is not None and model is not None else None
        self.act_modules = self.forward.names if self.forward is not None else []
        self.act_max = self.forward.max if self.forward is not None else math.nan
        self.groups, self._param_group = _groups(model)
        self._model_numel = self._numel_of(model.parameters()) if model is not None else None
        self.format = FORMATS[format] if isinstance(format, str) else format
        self.meta = dict(meta or {})
        self.scale_groups = list(getattr(strategy, "group_names", ["all"])) if getattr(strategy, "per_group", False) else ["all"]
        self.keep = keep
        self._kept = Trace(self.groups, self.group_numel, self.scale_groups, self.format, self.meta,
                           act_modules=list(self.act_modules), act_max=self.act_max) if keep else None
        self._buf: torch.Tensor | None = None
        self._n, self._first, self._lr = 0, 0, []
        self._hist: dict[int, Histogram] = {}
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._group_absmax: torch.Tensor | None = None
        self._scale_ran: torch.Tensor | None = None
        self._prev_scale: torch.Tensor | None = None

    # ------------------------------------------------------------------ shape
    def _numel_of(self, params: Iterable[torch.Tensor]) -> list[int]:
        out = [0] * len(self.groups)
        for p in params:
            if p.requires_grad:
                out[self._param_group.get(id(p), len(self.groups) - 1)] += p.numel()
        return out

    @property
    def group_numel(self) -> list[int]:
        return list(self._model_numel) if self._model_numel is not None else [0] * len(self.groups)

    def header(self) -> dict[str, Any]:
        """The trace file's header line."""
        return header_line(self.groups, self.group_numel, self.scale_groups, self.format, self.meta,
                           self.act_modules, self.act_max)

    def _state(self) -> Any:
        enabled = getattr(self.strategy, "is_enabled", lambda: False)()
        return getattr(self.strategy, "state", None) if enabled else None

    def _current_scale(self) -> torch.Tensor | None:
        state = self._state()
        return None if state is None else state.scale.detach().clone().reshape(-1).float()

    # ------------------------------------------------------------------ per step
    def unscaled(self, params: Iterable[torch.Tensor]) -> None:
        """After ``unscale_``: the abs-max of the unscaled gradients per layer group (one pass over
        them on the device, ``_foreach_norm``) and the scale the step ran at."""
        params = [p for p in params if p.grad is not None]
        self._scale_ran = self._current_scale()
        if not params:
            self._group_absmax = None
            return
        key = tuple(id(p) for p in params)
        if self._index is None or self._index[0] != key:
            gi = [self._param_group.get(id(p), len(self.groups) - 1) for p in params]
            self._index = (key, torch.tensor(gi, dtype=torch.int64, device=params[0].grad.device))
            if self._model_numel is None:
                self._model_numel = self._numel_of(params)
        grads = [p.grad.detach() for p in params]
        with torch.no_grad():
            amax = torch.stack(torch._foreach_norm(grads, math.inf)).float()
            amax = torch.nan_to_num(amax, nan=math.inf, posinf=math.inf)  # NaN reads as an overflow; +inf stays inf (not float max)
            index = self._index[1]
            self._group_absmax = torch.zeros(len(self.groups), device=amax.device).scatter_reduce_(
                0, index.to(amax.device), amax, "amax")

    def _stats_row(self, device: torch.device) -> list[torch.Tensor]:
        """found_inf, abs-max, sum of squares, zero and subnormal fractions of this step."""
        state, stats = self._state(), getattr(self.strategy, "_last_stats", None)
        nan = torch.full((), math.nan, device=device)
        ga = self._group_absmax
        if stats is not None and state is not None:
            t = stats.total()
            numel = t.numel.clamp(min=1).double()
            absmax, sumsq = t.absmax.reshape(()), t.sumsq.reshape(())
            zf, sf = (t.zeros / numel).float().reshape(()), (t.subnormals / numel).float().reshape(())
        else:
            absmax = ga.amax() if ga is not None else nan
            sumsq, zf, sf = nan, nan, nan
        if state is not None:
            found = state.found_inf.reshape(()).float()
        else:
            found = (~torch.isfinite(absmax)).float()
        return [t.to(device, torch.float32) for t in (found, absmax, sumsq, zf, sf)]

    def stepped(self, step: int, loss: torch.Tensor | float, lr: float) -> None:
        """After ``update()``: step ``step``'s row into the device buffer (no host read)."""
        loss_t = loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        device = loss_t.device
        found, absmax, sumsq, zf, sf = self._stats_row(device)
        scale = self._scale_ran if self._scale_ran is not None else self._prev_scale
        if scale is None:
            init = float(getattr(getattr(self.strategy, "params", None), "init_scale", 1.0)) if self._state() is not None else 1.0
            scale = torch.full((len(self.scale_groups),), init, device=device)
        ga = self._group_absmax
        if ga is None:
            stats = getattr(self.strategy, "_last_stats", None)
            per_group = stats is not None and stats.absmax.numel() == len(self.groups)
            ga = stats.absmax.float() if per_group else absmax.reshape(1).expand(len(self.groups)) \
                if len(self.groups) == 1 else torch.full((len(self.groups),), math.nan, device=device)
        lr_slot = torch.zeros((), device=device)  # the host's lr goes here at flush
        act = self.forward.take(device) if self.forward is not None else not_recorded(device)
        row = torch.cat([torch.stack([found, loss_t, absmax, sumsq, zf, sf, lr_slot]),
                         scale.to(device).reshape(-1), ga.to(device).reshape(-1), torch.stack(act)])
        self._append(step, row)
        self._lr.append(float(lr))
        self._prev_scale = self._current_scale()
        self._scale_ran, self._group_absmax = None, None

    def _append(self, step: int, row: torch.Tensor) -> None:
        if self._n == 0:
            self._first = step
        if self._buf is None or self._buf.shape[1] != row.numel() or self._buf.device != row.device:
            self._buf = torch.empty(64, row.numel(), device=row.device)
        elif self._n == self._buf.shape[0]:  # flushed late: grow, never read
            self._buf = torch.cat([self._buf, torch.empty_like(self._buf)])
        self._buf[self._n].copy_(row)
        self._n += 1

    def histogram(self, step: int, lo: int, counts: list[int], zeros: int = 0) -> None:
        """The activation-gradient exponent histogram measured at ``step`` (host values)."""
        self._hist[int(step)] = Histogram(int(lo), [int(c) for c in counts], int(zeros))

    # ------------------------------------------------------------------ out
    def flush(self) -> dict[str, Any] | None:
        """The rows since the last flush as one chunk (one host read), or None when there are none."""
        if self._n == 0 or self._buf is None:
            return None
        rows = self._buf[:self._n].tolist()
        lr_col = BASE_COLUMNS.index("lr")
        for row, lr in zip(rows, self._lr):
            row[lr_col] = lr
        chunk = encode_chunk(self._first, rows, self._hist)
        if self._kept is not None:
            self._kept.group_numel = self.group_numel
            for i, row in enumerate(rows):
                self._kept.add_row(self._first + i, row)
            self._kept.histograms.update(self._hist)
        self._n, self._lr, self._hist = 0, [], {}
        return chunk

    def remove(self) -> None:
        """Take the forward hooks off the model (recording goes on without the activation columns)."""
        if self.forward is not None:
            self.forward.remove()

    def trace(self) -> Trace:
        """Every row kept so far (``keep=True``), the unflushed ones flushed first."""
        if self._kept is None:
            raise RuntimeError("TraceRecorder(keep=False) keeps no rows: read the flushed chunks")
        self.flush()
        return self._kept
