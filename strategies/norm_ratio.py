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
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.registry import register_strategy
from strategies.stats import GradStats

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


@register_strategy("norm_ratio")
class NormRatioStrategy(Strategy):
    """Norm-ratio scaling: every ``probe_interval`` steps compare ``||g_fp32||`` with the
    unscaled mixed-precision ``||g_mp / S||`` and double / halve S past the thresholds; backoff/
    growth (torch's rule) in between (seed 003, section 3.2; full rule in the module docstring).

    Args:
        probe_interval: steps between probes (integer >= 1, default 50).
        threshold_high: ratio above which S doubles (default 8, > threshold_low).
        threshold_low: ratio below which S halves (default 0.125, > 0).
        ema_decay: d in [0, 1) of the geometric EMA of the ratio across probes (default 0.5).
        probe_layers: optional fnmatch patterns restricting the probed parameters by name.
        other arguments: see :class:`strategies.base.Strategy` (growth_interval etc. drive the
            backoff/growth rule between probes, torch's defaults).
    """

    needs_stats = False

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        probe_interval: int = 50,
        threshold_high: float = 8.0,
        threshold_low: float = 0.125,
        ema_decay: float = 0.5,
        probe_layers: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, **kwargs)
        self._probe_interval = v.int_at_least("probe_interval", probe_interval, 1)
        self._threshold_low = v.finite_positive("threshold_low", threshold_low)
        self._threshold_high = v.finite_positive("threshold_high", threshold_high)
        if self._threshold_high <= self._threshold_low:
            v.fail("threshold_high", f"> threshold_low ({self._threshold_low:g})", threshold_high)
        self._ema_decay = v.half_open_interval("ema_decay", ema_decay, 0.0, 1.0)
        if probe_layers is not None:
            if isinstance(probe_layers, str) or not all(isinstance(p, str) for p in probe_layers):
                v.fail("probe_layers", "a list of fnmatch patterns (strings) or None", probe_layers)
            probe_layers = list(probe_layers)
            if not probe_layers:
                v.fail("probe_layers", "a non-empty list or None", probe_layers)
        self._probe_layers: list[str] | None = probe_layers
        self._closure: Callable[[], torch.Tensor] | None = None
        self._ref_params: list[tuple[str | None, torch.Tensor]] | None = None
        self._model_params: list[tuple[str | None, torch.Tensor]] | None = None
        self._warned = False
        self._init_step = 0
        self._step_i = 0
        self._reset_probe()

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
        if self._probe_layers is not None:
            if any(n is None for n, _ in named) and self._model_params is not None:
                by_id = {id(p): n for n, p in self._model_params}
                named = [(n if n is not None else by_id.get(id(p)), p) for n, p in named]
            if any(n is None for n, _ in named):
                raise ValueError("probe_layers needs named parameters: pass params=model.named_parameters() "
                                 "to set_reference or call attach(model)")
            named = [(n, p) for n, p in named if _matches(n, self._probe_layers)]  # type: ignore[arg-type]
            if not named:
                raise ValueError(f"probe_layers {self._probe_layers!r} match no parameter")
        return [p for _, p in named]

    # ----------------------------------------------------------------- state
    def _reset_probe(self) -> None:
        self._probe_set: list[torch.Tensor] | None = None
        self._probe_ids: set[int] = set()
        self._probe_seen: set[int] = set()
        self._ref_sumsq: torch.Tensor | None = None
        self._mp_sumsq: torch.Tensor | None = None

    def _init_extra_state(self, device: torch.device) -> None:
        f = dict(dtype=torch.float32, device=device)
        self._log_ratio_ema = torch.zeros((), **f)
        self._ema_steps = torch.zeros((), dtype=torch.int32, device=device)
        self._last_ratio = torch.full((), math.nan, **f)
        self._probe_count = torch.zeros((), dtype=torch.int64, device=device)
        self._probe_time = torch.zeros((), dtype=torch.float64, device=device)
        self._probe_last_time = torch.zeros((), dtype=torch.float64, device=device)
        self._step_i = self._init_step

    def _is_probe_step(self) -> bool:
        return self._step_i % self._probe_interval == 0

    # ----------------------------------------------------------------- the probe
    def _unscale_grads_(self, optimizer: torch.optim.Optimizer) -> None:
        super()._unscale_grads_(optimizer)
        if not self._is_probe_step():
            return
        if self._closure is None:
            if not self._warned:
                warnings.warn("norm_ratio: no reference closure (set_reference) — behaving as "
                              "backoff/growth (native) until one is given", stacklevel=4)
                self._warned = True
            return
        assert self._scale is not None
        t0 = time.perf_counter()
        if self._probe_set is None:
            self._run_reference(optimizer)
        self._accumulate_mp(optimizer)
        dt = time.perf_counter() - t0
        self._probe_time.add_(dt)
        self._probe_last_time.add_(dt)

    def _run_reference(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._scale is not None and self._closure is not None
        params = self._probe_params(optimizer)
        self._probe_set = params
        self._probe_ids = {id(p) for p in params}
        self._probe_last_time.zero_()
        self._probe_count.add_(1)
        dev = self._scale.device
        with torch.enable_grad(), torch.autocast(dev.type, enabled=False):
            loss = self._closure()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("norm_ratio: the reference closure must return a scalar loss tensor")
            grads = torch.autograd.grad(loss.float().reshape(()), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
        if self._dist_mode() == "replicated":
            # DDP: the mixed-precision gradient is the mean over ranks of each rank's batch
            # gradient, so the reference must be that mean too (the probe's one collective).
            flat = torch.cat([g.float().reshape(-1).to(dev) for g in grads]) if grads \
                else torch.zeros(0, device=dev)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(dist.get_world_size())
            self._ref_sumsq = flat.square().sum()
            return
        sq = [g.float().square().sum().to(dev) for g in grads]
        self._ref_sumsq = torch.stack(sq).sum() if sq else torch.zeros((), device=dev)

    def _dist_mode(self) -> str | None:
        """None (single process), ``"replicated"`` (DDP) or ``"sharded"`` (see the base class)."""
        if not self._distributed_active():
            return None
        return "sharded" if self._distributed == "sharded" else "replicated"

    def _accumulate_mp(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._scale is not None
        dev = self._scale.device
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
    def _update_scale(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert self._scale is not None and self._growth_tracker is not None
        probed = self._ref_sumsq is not None
        zero = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        mode = self._dist_mode()
        if probed and mode is not None:
            # Every rank takes the same decision: the norms are reduced like the statistics
            # (replicated: MAX, the values agree unless a rank's gradient was changed after
            # backward; sharded: SUM of the ranks' disjoint shares).
            assert self._ref_sumsq is not None
            pair = torch.stack([self._ref_sumsq.float(),
                                (self._mp_sumsq if self._mp_sumsq is not None else zero).float()])
            dist.all_reduce(pair, op=dist.ReduceOp.SUM if mode == "sharded" else dist.ReduceOp.MAX)
            self._ref_sumsq, self._mp_sumsq = pair[0], pair[1]
        args = (
            self._scale, self._growth_tracker, self._log_ratio_ema, self._ema_steps, self._last_ratio,
            found_inf,
            self._ref_sumsq if probed else zero,
            (self._mp_sumsq if self._mp_sumsq is not None else zero) if probed else zero,
            probed,
            self._growth_factor, self._backoff_factor, self._growth_interval,
            self._threshold_high, self._threshold_low, self._ema_decay,
        )
        kernels.dispatch("norm_ratio_update_", norm_ratio_update_, *args)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As :meth:`Strategy.update`; also advances the (host-side) probe schedule."""
        super().update(new_scale)
        if self._enabled:
            self._step_i += 1
            self._reset_probe()

    # ----------------------------------------------------------------- checkpoints, telemetry
    def _extra_state_dict(self) -> dict[str, Any]:
        return {
            "step": self._step_i,
            "log_ratio_ema": float(self._log_ratio_ema.item()),
            "ema_steps": int(self._ema_steps.item()),
            "probe_count": int(self._probe_count.item()),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._step_i = int(state.get("step", 0))
        self._init_step = self._step_i
        self._log_ratio_ema.fill_(float(state.get("log_ratio_ema", 0.0)))
        self._ema_steps.fill_(int(state.get("ema_steps", 0)))
        self._probe_count.fill_(int(state.get("probe_count", 0)))

    def _extra_telemetry(self) -> dict[str, torch.Tensor]:
        return {
            "probe_count": self._probe_count.clone(),
            "probe_time_s": self._probe_time.clone(),
            "probe_last_time_s": self._probe_last_time.clone(),
            "norm_ratio": self._last_ratio.clone(),
            "norm_ratio_ema": torch.exp2(self._log_ratio_ema),
        }
