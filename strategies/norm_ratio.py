"""``norm_ratio``: norm-ratio scaling against a periodic fp32 reference gradient.

Rule (seed 003, section 3.2 "基于梯度范数比例的自适应缩放 (Norm Ratio Scaling)", thresholds from
section 4.6). Every ``probe_interval`` steps the strategy differentiates an fp32 reference loss
and compares norms over the probed parameters P:

    r = ||g_fp32||_2 / ||g_mp / S||_2

where ``g_mp / S`` are the unscaled mixed-precision gradients of the same step. ``r >> 1`` means
the mixed-precision gradient lost mass (underflow), ``r << 1`` that it gained some (overflow
clipped to the format's max, or a broken fp32 side). Precisely, on a probe step:

1. ``log2 r`` (clamped to [-16, 16] so that a fully underflowed ``||g_mp|| = 0`` reads as a very
   large, finite ratio) feeds a geometric EMA ``m <- d * m + (1 - d) * log2 r``, initialised to
   ``log2 r`` at the first valid probe (``d = ema_decay = 0.5``; 0 = no smoothing). Averaging
   the logarithm treats a ratio of 8 and of 1/8 symmetrically.
2. With ``r_bar = 2^m``: ``r_bar > threshold_high`` (8) -> ``a = growth_factor`` (x2);
   ``r_bar < threshold_low`` (0.125) -> ``a = backoff_factor`` (x0.5); otherwise ``a = 1``.
   So a probe never moves S by more than the growth/backoff limits.
3. ``a != 1``: ``S <- S * a`` (a non-finite result is rejected) and the growth tracker restarts;
   this replaces the backoff/growth rule for that step. ``a == 1``: the step follows the
   backoff/growth rule below.

Every other step — and every step while no closure is set (a warning is issued once) — follows
``torch.amp.GradScaler``'s backoff/growth rule (``torch._amp_update_scale_``: overflow ->
``x backoff_factor``; ``growth_interval`` clean steps in a row -> ``x growth_factor``). A step with
non-finite gradients is skipped and backed off, probe or not; its probe result is discarded
(EMA not fed). A probe whose reference norm is not finite, or where both norms are 0, is
discarded too.

Where the probe runs and what it costs: in :meth:`unscale_` (called by :meth:`step` if the loop
did not call it) of every step ``k`` with ``k % probe_interval == 0`` (k counts :meth:`update`
calls from 0, skipped steps included, so the first step probes), at the first optimizer unscaled
in that step — i.e. *before* any ``optimizer.step()`` changes the parameters, so both gradients
are taken at the same point. The closure recomputes the loss of the current batch; the strategy
runs it with autocast disabled and differentiates it with ``torch.autograd.grad(loss, P)``,
which never touches ``.grad``. The probe is not a training step: nothing is applied. Its cost
(one fp32 forward + backward over P, plus the norm of P's unscaled mixed-precision gradients) is
the only extra work of this strategy; ``telemetry()`` reports ``probe_count``, ``probe_time_s``
(cumulative host wall time from ``time.perf_counter``: on CUDA this is the time to *enqueue* the
probe, not to run it, because no sync is allowed), ``probe_last_time_s``, ``norm_ratio`` (last
raw r) and ``norm_ratio_ema`` (r_bar).

Distributed (``distributed`` keyword, see the base class): under DDP ("replicated") the probe
all-reduces the reference gradients to their mean over ranks — the quantity the DDP-averaged
mixed-precision gradient estimates — and both sums of squares are then MAX-reduced, so every
rank computes the same ratio and scale; "sharded" SUM-reduces the ranks' sums of squares (the
closure must then differentiate the rank's own shard). The closure runs the plain module, not the
DDP wrapper.

P: the ``params`` given to :meth:`set_reference` (tensors, or ``(name, tensor)`` pairs such as
``model.named_parameters()``), else the parameters of the model given to :meth:`attach`, else
those of the first optimizer unscaled in the probe step; restricted by ``probe_layers`` (fnmatch
patterns over parameter or module names, e.g. ``["encoder.0.*", "head"]``) to cut the cost
(unnamed tensors are named through the attached model). With
gradient accumulation the closure must return the loss of everything accumulated.
"""

from __future__ import annotations

import fnmatch
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence

import torch

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.params import ScalerParams, hp
from strategies.reference import fp32_loss
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats, mean_over_ranks_

LOG2_RATIO_CLAMP = 16.0


def norm_ratio_update_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    log_ratio_ema: torch.Tensor,
    ema_steps: torch.Tensor,
    last_ratio: torch.Tensor,
    found_inf: torch.Tensor,
    ref_sumsq: torch.Tensor,
    mp_sumsq: torch.Tensor,
    probed: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    threshold_high: float,
    threshold_low: float,
    ema_decay: float,
) -> None:
    """The norm-ratio rule, in place on the device (no host sync). Scalar tensors.

    Args:
        scale: float32 S; growth_tracker: int32 (torch's semantics).
        log_ratio_ema: float32 m, the EMA of log2 r; ema_steps: int32 count of valid probes.
        last_ratio: float32, written with this probe's raw r (untouched when not ``probed``).
        found_inf: float32, > 0 when the step's gradients were non-finite.
        ref_sumsq, mp_sumsq: float32 sums of squares of the fp32 reference gradient and of the
            unscaled mixed-precision gradient over the probed parameters (ignored unless
            ``probed``).
        probed: whether this step carries a probe (a host bool: the probe schedule is host-side).
        other arguments: the hyper-parameters (see the module docstring).
    """
    if not probed:
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return
    s_native, t_native = scale.clone(), growth_tracker.clone()
    torch._amp_update_scale_(s_native, t_native, found_inf, growth_factor, backoff_factor, growth_interval)

    ref, mp = ref_sumsq.sqrt(), mp_sumsq.sqrt()
    last_ratio.copy_(ref / mp)
    found = found_inf > 0
    valid = ~found & torch.isfinite(ref) & torch.isfinite(mp) & ((ref > 0) | (mp > 0))
    log_r = (torch.log2(ref) - torch.log2(mp)).nan_to_num(0.0).clamp(-LOG2_RATIO_CLAMP, LOG2_RATIO_CLAMP)
    m_fed = torch.where(ema_steps > 0, log_ratio_ema * ema_decay + log_r * (1.0 - ema_decay), log_r)
    m = torch.where(valid, m_fed.to(torch.float32), log_ratio_ema)

    one = torch.ones_like(scale)
    a = torch.where(m > math.log2(threshold_high), one * growth_factor,
                    torch.where(m < math.log2(threshold_low), one * backoff_factor, one))
    acted = valid & (a != 1)
    moved = (scale * a).to(torch.float32)
    moved = torch.where(torch.isfinite(moved) & (moved > 0), moved, scale)

    scale.copy_(torch.where(acted, moved, s_native))
    growth_tracker.copy_(torch.where(acted, torch.zeros_like(t_native), t_native))
    log_ratio_ema.copy_(m)
    ema_steps.add_(valid.to(ema_steps.dtype))


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


@dataclass
class NormRatioParams(ScalerParams):
    probe_interval: int = hp(50, v.integer(1), "seed 003 §3.2", "steps between fp32 reference probes")
    threshold_high: float = hp(8.0, v.finite_positive, "seed 003 §4.6", "ratio above which S doubles")
    threshold_low: float = hp(0.125, v.finite_positive, "seed 003 §4.6", "ratio below which S halves")
    ema_decay: float = hp(0.5, v.between(0.0, 1.0, "[)"), "scalelab", "geometric EMA of the ratio across probes")
    probe_layers: Optional[List[str]] = hp(None, v.patterns, "scalelab",
                                           "fnmatch patterns over parameter names restricting the probe")

    def check(self) -> None:
        super().check()
        if self.threshold_high <= self.threshold_low:
            v.fail("threshold_high", f"> threshold_low ({self.threshold_low:g})", self.threshold_high)


@register_strategy("norm_ratio")
class NormRatioStrategy(Strategy):
    """Norm-ratio scaling: every ``probe_interval`` steps compare ``||g_fp32||`` with the
    unscaled mixed-precision ``||g_mp / S||`` and double / halve S past the thresholds; backoff/
    growth (torch's rule) in between (seed 003, section 3.2; full rule in the module docstring).
    Give the reference with :meth:`set_reference`."""

    Params = NormRatioParams
    state_spec = (
        State("log_ratio_ema", torch.float32, 0.0),
        State("ema_steps", torch.int32, 0, low=0),
        State("probe_count", torch.int64, 0, low=0),
        State("norm_ratio", torch.float32, math.nan, saved=False),
        State("probe_time_s", torch.float64, 0.0, saved=False),
        State("probe_last_time_s", torch.float64, 0.0, saved=False),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closure: Callable[[], torch.Tensor] | None = None
        self._ref_params: list[tuple[str | None, torch.Tensor]] | None = None
        self._model_params: list[tuple[str | None, torch.Tensor]] | None = None
        self._warned = False
        self._reset_probe(-1)

    # ----------------------------------------------------------------- loop helpers
    def set_reference(self, closure: Callable[[], torch.Tensor] | None,
                      params: Iterable[Any] | None = None) -> None:
        """Give the fp32 reference: ``closure()`` returns the loss of the current batch (it is
        run with autocast disabled, at the probe, before the optimizer steps); ``params`` (tensors
        or ``(name, tensor)`` pairs) are the parameters it is differentiated over. ``None``
        clears the closure."""
        if closure is not None and not callable(closure):
            v.fail("closure", "callable or None", closure)
        self._closure = closure
        self._ref_params = None if params is None else self._named(params)

    def attach(self, model: torch.nn.Module) -> "NormRatioStrategy":
        """Remember ``model``'s named parameters as the default probed set (no hooks)."""
        self._model_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return self

    def detach(self) -> None:
        self._model_params = None

    @staticmethod
    def _named(params: Iterable[Any]) -> list[tuple[str | None, torch.Tensor]]:
        out: list[tuple[str | None, torch.Tensor]] = []
        for item in params:
            if isinstance(item, torch.Tensor):
                out.append((None, item))
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                out.append((str(item[0]), item[1]))
            else:
                v.fail("params", "tensors or (name, tensor) pairs", item)
        return out

    def _probe_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        named = self._ref_params or self._model_params
        if named is None:
            named = [(None, p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        patterns = self.params.probe_layers
        if patterns is not None:
            if any(n is None for n, _ in named) and self._model_params is not None:
                by_id = {id(p): n for n, p in self._model_params}
                named = [(n if n is not None else by_id.get(id(p)), p) for n, p in named]
            if any(n is None for n, _ in named):
                raise ValueError("probe_layers needs named parameters: pass params=model.named_parameters() "
                                 "to set_reference or call attach(model)")
            named = [(n, p) for n, p in named if _matches(n, patterns)]  # type: ignore[arg-type]
            if not named:
                raise ValueError(f"probe_layers {patterns!r} match no parameter")
        return [p for _, p in named]

    # ----------------------------------------------------------------- the probe
    def _reset_probe(self, step: int) -> None:
        """Forget the probe scratch of an earlier step (host-side lists and the two sums)."""
        self._probe_step = step
        self._probe_set: list[torch.Tensor] | None = None
        self._probe_ids: set[int] = set()
        self._probe_seen: set[int] = set()
        self._ref_sumsq: torch.Tensor | None = None
        self._mp_sumsq: torch.Tensor | None = None

    def on_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """On probe steps (``updates % probe_interval == 0``): the fp32 reference at the first
        optimizer unscaled in the step, and the mixed-precision norm of every probed gradient."""
        if self._probe_step != self.updates:
            self._reset_probe(self.updates)
        if self.updates % self.params.probe_interval != 0:
            return
        if self._closure is None:
            if not self._warned:
                warnings.warn("norm_ratio: no reference closure (set_reference) — behaving as "
                              "backoff/growth (native) until one is given", stacklevel=3)
                self._warned = True
            return
        s = self.state
        t0 = time.perf_counter()
        if self._probe_set is None:
            s.probe_last_time_s.zero_()
            s.probe_count.add_(1)
            self._run_reference(optimizer)
        self._accumulate_mp(optimizer)
        dt = time.perf_counter() - t0
        s.probe_time_s.add_(dt)
        s.probe_last_time_s.add_(dt)

    def _run_reference(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._closure is not None
        params = self._probe_params(optimizer)
        self._probe_set = params
        self._probe_ids = {id(p) for p in params}
        dev = self.state.scale.device
        with torch.enable_grad():
            loss = fp32_loss(self._closure, dev.type, "norm_ratio")
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("norm_ratio: the reference closure must return a scalar loss tensor")
            grads = torch.autograd.grad(loss.float().reshape(()), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
        if self._distributed_mode() == "replicated":
            # DDP: the mixed-precision gradient is the mean over ranks of each rank's batch
            # gradient, so the reference must be that mean too.
            flat = torch.cat([g.float().reshape(-1).to(dev) for g in grads]) if grads \
                else torch.zeros(0, device=dev)
            self._ref_sumsq = mean_over_ranks_(flat).square().sum()
            return
        sq = [g.float().square().sum().to(dev) for g in grads]
        self._ref_sumsq = torch.stack(sq).sum() if sq else torch.zeros((), device=dev)

    def _accumulate_mp(self, optimizer: torch.optim.Optimizer) -> None:
        dev = self.state.scale.device
        mine = [p.grad for g in optimizer.param_groups for p in g["params"]
                if id(p) in self._probe_ids and id(p) not in self._probe_seen and p.grad is not None]
        self._probe_seen.update(id(p) for g in optimizer.param_groups for p in g["params"])
        if not mine:
            return
        with torch.no_grad():
            norms = torch._foreach_norm([g if not g.is_sparse else g._values() for g in mine], 2,
                                        dtype=torch.float32)
            sq = torch.stack([n.to(dev) for n in norms]).square().sum()
        self._mp_sumsq = sq if self._mp_sumsq is None else self._mp_sumsq + sq

    # ----------------------------------------------------------------- the rule
    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        p, s = self.params, self.state
        dev = s.scale.device
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        probed = self._probe_step == self.updates and self._ref_sumsq is not None
        ref = self._ref_sumsq.float() if probed else zero
        mp = self._mp_sumsq.float() if probed and self._mp_sumsq is not None else zero
        mode = self._distributed_mode()
        if probed and mode is not None:
            # Every rank takes the same decision: the probe's two sums reduce like the statistics
            # (group 0 = reference, group 1 = mixed precision).
            pair = GradStats.empty(2, dev)
            pair.sumsq.copy_(torch.stack([ref, mp]))
            ref, mp = pair.all_reduce(mode).sumsq.unbind()
        kernels.dispatch("norm_ratio_update_", norm_ratio_update_, s.scale, s.growth_tracker, s.log_ratio_ema,
                         s.ema_steps, s.norm_ratio, found_inf, ref, mp, probed, p.growth_factor,
                         p.backoff_factor, p.growth_interval, p.threshold_high, p.threshold_low, p.ema_decay)
