"""The fp32 reference probe shared by the rules that calibrate against it (``norm_ratio``, ``hybrid``).

Two pieces, both factored out of ``norm_ratio`` unchanged (its behaviour and tests are the
oracle):

* :class:`ReferenceProbe` — the host-side machinery, a mixin placed before :class:`Strategy`:
  :meth:`~ReferenceProbe.set_reference`, ``attach``/``detach`` (the default probed parameter
  set), and the ``on_unscale`` hook that, on a probe step, differentiates the fp32 reference
  loss at the first optimizer unscaled in the step (before any ``optimizer.step()``) and sums the
  squares of the fp32 and of the unscaled mixed-precision gradients over the probed parameters
  P. :meth:`~ReferenceProbe.probe_sums` hands the step's two sums to the rule, reduced over ranks
  (DDP: reference averaged over ranks, MAX; a ZeRO partition: averaged, summed over the share each
  rank's optimizers hold, SUM; FSDP: FSDP's own backward, :mod:`strategies.probe_sharded`, SUM).
  Which steps probe is the host-side :meth:`~ReferenceProbe.probe_due` (default: every
  ``probe_interval``-th :meth:`update`, step 0 included). The rule's ``Params`` include
  :class:`ProbeRule` (``probe_interval``, the thresholds, ``probe_layers``); its ``state_spec``
  includes :data:`PROBE_STATE`.
* :func:`ratio_probe_` — the device-side decision from the two sums (no host sync): the ratio
  ``r = ||g_fp32|| / ||g_mp / S||``, its log2 clamped to [-16, 16] and fed to a geometric EMA,
  and the factor ``a`` (``growth_factor`` above ``threshold_high``, ``backoff_factor`` below
  ``threshold_low``, else 1). See ``strategies/rules/norm_ratio.py`` for the full rule and its sources.
"""

from __future__ import annotations

import fnmatch
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, List, Optional, Sequence

import torch
from torch.amp.grad_scaler import OptState

from strategies import kernels
from strategies import validation as v
from strategies.params import hp
from strategies.reference import fp32_loss
from strategies.state import State
from strategies.probe_sharded import is_wrapped, wrapped_reference_sumsq
from strategies.sharding import local, mean_over_ranks_
from strategies.stats import GradStats

__all__ = ["LOG2_RATIO_CLAMP", "PROBE_STATE", "ProbeRule", "ReferenceProbe", "ratio_probe_"]

LOG2_RATIO_CLAMP = 16.0

PROBE_STATE = (
    State("probe_count", torch.int64, 0, low=0),
    State("norm_ratio", torch.float32, math.nan, saved=False),
    State("probe_time_s", torch.float64, 0.0, saved=False),
    State("probe_last_time_s", torch.float64, 0.0, saved=False),
)
"""State every probing rule declares: reference runs so far, the last raw ratio r, and the
cumulative / last host wall time of the probe (``time.perf_counter``; on CUDA the time to enqueue)."""


@dataclass
class ProbeRule:
    """The probe's hyper-parameters (shared by ``norm_ratio`` and ``hybrid``)."""

    probe_interval: int = hp(50, v.integer(1), "seed 003 §3.2", "steps between fp32 reference probes")
    threshold_high: float = hp(8.0, v.finite_positive, "seed 003 §4.6", "ratio above which S doubles")
    threshold_low: float = hp(0.125, v.finite_positive, "seed 003 §4.6", "ratio below which S halves")
    probe_layers: Optional[List[str]] = hp(None, v.patterns, "scalelab",
                                           "fnmatch patterns over parameter names restricting the probe")

    def check(self) -> None:
        super().check()  # type: ignore[misc]
        if self.threshold_high <= self.threshold_low:
            v.fail("threshold_high", f"> threshold_low ({self.threshold_low:g})", self.threshold_high)


def ratio_probe_(
    scale: torch.Tensor, log_ratio_ema: torch.Tensor, ema_steps: torch.Tensor, last_ratio: torch.Tensor,
    found_inf: torch.Tensor, ref_sumsq: torch.Tensor, mp_sumsq: torch.Tensor, live: torch.Tensor | None,
    growth_factor: float, backoff_factor: float, threshold_high: float, threshold_low: float, ema_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm-ratio probe's decision, on the device (no host sync). Scalar tensors.

    Writes ``last_ratio`` with this reference's raw ``r``; where the probe is valid (``live``
    — None: always — a finite step, both norms finite, not both 0) feeds ``log_ratio_ema`` (m,
    the EMA of log2 r with decay ``ema_decay``; initialised at the first valid probe) and counts
    it in ``ema_steps``. Returns ``(acted, moved)``: ``acted`` is True where the probe was valid
    and ``2^m`` crossed a threshold, ``moved = S * a`` (``a = growth_factor`` above
    ``threshold_high``, ``backoff_factor`` below ``threshold_low``), with a non-finite or
    non-positive result rejected (``S`` kept). ``scale`` itself is not written.
    """
    # sqrt and log2 in double, rounded once to float32, as the rule header computes them
    # (scalelab_common.h): torch's float32 sqrt/log2 on the CPU (MKL) are not correctly rounded.
    ref, mp = kernels.f32_of_double(torch.sqrt, ref_sumsq), kernels.f32_of_double(torch.sqrt, mp_sumsq)
    last_ratio.copy_(ref / mp)
    found = found_inf != 0
    valid = ~found & torch.isfinite(ref) & torch.isfinite(mp) & ((ref > 0) | (mp > 0))
    if live is not None:
        valid = valid & live
    log_r = (kernels.f32_of_double(torch.log2, ref) - kernels.f32_of_double(torch.log2, mp)).nan_to_num(0.0)
    log_r = log_r.clamp(-LOG2_RATIO_CLAMP, LOG2_RATIO_CLAMP)
    m_fed = torch.where(ema_steps > 0, log_ratio_ema * ema_decay + log_r * (1.0 - ema_decay), log_r)
    m = torch.where(valid, m_fed.to(torch.float32), log_ratio_ema)

    one = torch.ones_like(scale)
    a = torch.where(m > math.log2(threshold_high), one * growth_factor,
                    torch.where(m < math.log2(threshold_low), one * backoff_factor, one))
    acted = valid & (a != 1)
    moved = (scale * a).to(torch.float32)
    moved = torch.where(torch.isfinite(moved) & (moved > 0), moved, scale)
    log_ratio_ema.copy_(m)
    ema_steps.add_(valid.to(ema_steps.dtype))
    return acted, moved


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


class ReferenceProbe:
    """Mixin (``class Rule(ReferenceProbe, Strategy)``): the fp32 reference probe's host side.

    ``probe_fallback`` names, in the one-time warning issued while no closure is set, what the
    rule does instead."""

    probe_fallback: ClassVar[str] = "its rule without the probe"
    reads_scaled: ClassVar[bool] = True  # a fused optimizer's still-scaled gradients: the norm x 1/S

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
        self._ranks_agree = False  # every rank must probe alike: checked at the next step (strategies.agreement)

    def attach(self, model: torch.nn.Module) -> Any:
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
    def probe_due(self) -> bool:
        """Whether this step (``self.updates``) runs the reference: every ``probe_interval``-th."""
        return self.updates % self.params.probe_interval == 0

    def _reset_probe(self, step: int) -> None:
        """Forget the probe scratch of an earlier step (host-side lists and the two sums)."""
        self._probe_step = step
        self._probe_set: list[torch.Tensor] | None = None
        self._probe_ids: set[int] = set()
        self._probe_seen: set[int] = set()
        self._ref_sumsq: torch.Tensor | None = None
        self._mp_sumsq: torch.Tensor | None = None
        self._ref_parts: list[tuple[int, torch.Tensor]] = []  # sharded partition: (id(param), mean reference)
        self._probe_reduce: str | None = None  # how the two sums are reduced across ranks

    def on_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """On probe steps (:meth:`probe_due`): the fp32 reference at the first optimizer unscaled
        in the step, and the mixed-precision norm of every probed gradient."""
        if self._probe_step != self.updates:
            self._reset_probe(self.updates)
        if not self.probe_due():
            return
        if self._closure is None:
            if not self._warned:
                warnings.warn(f"{self.name}: no reference closure (set_reference) — behaving as "
                              f"{self.probe_fallback} until one is given", stacklevel=3)
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
        mode = self._distributed_mode()
        self._probe_reduce = None if mode is None else "replicated"
        if mode is not None and any(is_wrapped(p) for p in params):  # FSDP: the wrapper's own backward
            self._probe_reduce = "sharded"
            touched = [p for _, p in (self._model_params or []) + (self._ref_params or [])]
            touched += [p for g in optimizer.param_groups for p in g["params"]]
            self._ref_sumsq = wrapped_reference_sumsq(self._closure, params, touched, dev, self.name)
            return
        with torch.enable_grad():
            loss = fp32_loss(self._closure, dev.type, self.name)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"{self.name}: the reference closure must return a scalar loss tensor")
            grads = torch.autograd.grad(loss.float().reshape(()), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
        if mode is not None:
            # DDP: the mixed-precision gradient is the mean over ranks of each rank's batch
            # gradient, so the reference must be that mean too.
            flat = torch.cat([g.float().reshape(-1).to(dev) for g in grads]) if grads \
                else torch.zeros(0, device=dev)
            mean = mean_over_ranks_(flat)
            if mode == "sharded":  # a partition (ZeRO): each rank sums the share its optimizers hold
                if self._ref_params is None and self._model_params is None:
                    raise ValueError(f"{self.name}: under distributed='sharded' the fp32 probe needs the same parameter "
                                     "list on every rank: pass params=model.parameters() to set_reference or "
                                     "attach(model)")
                self._probe_reduce = "sharded"
                self._ref_parts = list(zip([id(p) for p in params], mean.split([g.numel() for g in grads])))
                self._ref_sumsq = mean.new_zeros(())
                return
            self._ref_sumsq = mean.square().sum()
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
            mine = [local(g) for g in mine]
            norms = torch._foreach_norm([g if not g.is_sparse else g._values() for g in mine], 2,
                                        dtype=torch.float32)
            sq = torch.stack([n.to(dev) for n in norms]).square().sum()
            if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:  # read for a fused step
                inv = self.state.scale.double().reciprocal().float()  # as the pass: exact for a power of two
                sq = sq * (inv * inv)
        self._mp_sumsq = sq if self._mp_sumsq is None else self._mp_sumsq + sq

    def probe_sums(self) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """``(probed, ref_sumsq, mp_sumsq)`` of this step, for the rule's ``update_``: ``probed``
        (host bool) is whether a reference ran; the two float32 sums (0 when not probed) are
        reduced over ranks like the statistics, so every rank takes the same decision."""
        dev = self.state.scale.device
        zero = getattr(self, "_zero_sum", None)
        if zero is None or zero.device != dev:  # one read-only zero, not a new tensor every step
            zero = self._zero_sum = torch.zeros((), dtype=torch.float32, device=dev)
        probed = self._probe_step == self.updates and self._ref_sumsq is not None
        if probed and self._ref_parts:  # a partition: the reference over the parameters the optimizers hold
            self._ref_sumsq = torch.stack([self._ref_sumsq] + [part.square().sum() for i, part in self._ref_parts
                                                               if i in self._probe_seen]).sum()
            self._ref_parts = []
        ref = self._ref_sumsq.float() if probed else zero
        mp = self._mp_sumsq.float() if probed and self._mp_sumsq is not None else zero
        if probed and self._probe_reduce is not None:
            # group 0 = reference, group 1 = mixed precision; replicated: MAX, sharded: SUM
            pair = GradStats.empty(2, dev)
            pair.sumsq.copy_(torch.stack([ref, mp]))
            ref, mp = pair.all_reduce(self._probe_reduce).sumsq.unbind()
        return probed, ref, mp
