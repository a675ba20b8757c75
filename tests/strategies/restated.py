"""The loss scalers of other projects, restated line for line in plain Python: the oracles of the
rule tests (each test drives a strategy through real scale/unscale_/step/update calls and compares
its scale after every update with these).

* :class:`Torch` — ``torch.amp.GradScaler``'s update, ``_amp_update_scale_``
  (``aten/src/ATen/native/cuda/AmpKernels.cu``), as verl's ``ShardedGradScaler`` runs it;
* :class:`Megatron` — Megatron-LM ``megatron/core/optimizer/grad_scaler.py`` ``DynamicGradScaler.update``;
* :class:`DeepSpeed` — DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``
  (``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``, ``raise_error_at_min_scale``);
* :class:`Apex` — Apex ``csrc/update_scale_hysteresis.cu`` ``update_scale_hysteresis_cuda_kernel``;
* :class:`Fairseq` — fairseq ``fairseq/optim/dynamic_loss_scaler.py`` ``DynamicLossScaler``
  (``check_overflow`` on an overflowing step, ``update`` after a clean one, as
  ``fairseq/optim/fp16_optimizer.py`` calls them);
* :class:`Metaseq` — metaseq ``metaseq/optim/dynamic_loss_scaler.py`` ``DynamicLossScaler``, whose
  growth window follows the scale (called as ``metaseq/optim/fp16_optimizer.py`` does).
"""

from __future__ import annotations

__all__ = ["Apex", "DeepSpeed", "Fairseq", "Megatron", "Metaseq", "Torch", "fairseq_trajectory",
           "metaseq_trajectory"]


class Torch:
    """``_amp_update_scale_`` (torch), Python floats for its one-element tensors."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.growth_tracker = init_scale, 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = self.scale * self.growth_factor
                if new_scale != float("inf"):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful


class Megatron:
    """``DynamicGradScaler.update`` (Megatron-LM), Python floats for its one-element tensors."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self._scale, self.min_scale = initial_scale, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


class DeepSpeed:
    """``DynamicLossScaler.update_scale`` (DeepSpeed), without its logging."""

    def __init__(self, init_scale, scale_factor, scale_window, min_scale, delayed_shift,
                 consecutive_hysteresis, raise_error_at_min_scale):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = scale_factor, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                else:
                    self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class Apex:
    """``update_scale_hysteresis_cuda_kernel`` (Apex), one thread's body."""

    def __init__(self, scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale, self.growth_tracker, self.hysteresis_tracker = scale, 0, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis

    def update(self, found_inf: float) -> None:
        if found_inf > 0:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.growth_tracker = 0
                return
        if found_inf:
            self.scale = self.scale * self.backoff_factor
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = self.scale * self.growth_factor
                if new_scale != float("inf"):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
        if found_inf <= 0:
            self.hysteresis_tracker = self.hysteresis


class Fairseq:
    """``DynamicLossScaler`` (fairseq), ``update`` and ``check_overflow`` as written."""

    def __init__(self, init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0, threshold=None,
                 min_loss_scale=1e-4):
        self.loss_scale = init_scale
        self.scale_factor, self.scale_window = scale_factor, scale_window
        self.tolerance, self.threshold = tolerance, threshold
        self._iter, self._last_overflow_iter, self._last_rescale_iter = 0, -1, -1
        self._overflows_since_rescale = 0
        self.min_loss_scale = min_loss_scale

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, overflow):
        if overflow:
            prev_scale = self.loss_scale
            iter_since_rescale = self._iter - self._last_rescale_iter
            if iter_since_rescale == 0:
                iter_since_rescale = 1000
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale <= self.min_loss_scale:
                self.loss_scale = prev_scale
                raise FloatingPointError("Minimum loss scale reached")
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


def fairseq_trajectory(ref: Fairseq, flags: list[int]) -> tuple[list[float], int | None]:
    """fairseq's scale after every step and the 1-based step at which it stopped (None: never)."""
    out = []
    for i, f in enumerate(flags):
        try:
            ref.check_overflow(bool(f))
            ref.update()
        except OverflowError:
            pass
        except FloatingPointError:
            return out, i + 1
        out.append(ref.loss_scale)
    return out, None


class Metaseq(Fairseq):
    """metaseq's ``DynamicLossScaler``: fairseq's state and ``__init__`` with metaseq's defaults;
    ``update``, ``_decrease_loss_scale`` and ``check_overflow`` as written in metaseq."""

    def __init__(self, init_scale=4.0, scale_factor=2.0, scale_window=256, tolerance=0.0, threshold=None,
                 min_loss_scale=2**-5):
        super().__init__(init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale)

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
            self.scale_window *= self.scale_factor
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        self.scale_window = max(int(self.scale_window / self.scale_factor), 1)
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, overflow):
        if overflow:
            prev_scale = self.loss_scale
            iter_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale < self.min_loss_scale:
                self.loss_scale = prev_scale
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


def metaseq_trajectory(ref: Metaseq, flags: list[int]) -> list[float]:
    out = []
    for f in flags:
        try:
            ref.check_overflow(bool(f))
            ref.update()
        except OverflowError:
            pass
        out.append(ref.loss_scale)
    return out
