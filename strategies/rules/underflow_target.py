"""``underflow_target``: place S from the measured exponent histogram of the activation gradients.

Rule (seed 003 §5.3: scaling "based on the gradient histogram rather than only max or norm";
the target rate is AdaLoss's, Zhao et al. 2019, arXiv 1910.12385). :meth:`attach` observes the
activation gradients at the model's layer boundaries (:mod:`strategies.boundaries`, stage
``"observe"``: what the layer below receives; only in backwards of a loss that went through this
strategy's :meth:`scale`, so an unscaled backward leaves the histogram alone) and counts, on the device, the exponents
``e = floor(log2 |g|)`` of their nonzero finite entries — at the current scale S. At
:meth:`update`, with ``h[e]`` those counts, ``N`` their sum, ``e_min = log2(smallest_normal)``
and ``cdf[j] = sum_{e <= j} h[e]``:

* scaling by ``2^k`` moves every exponent by k, so the fraction of entries left below the
  smallest normal is ``cdf[e_min - 1 - k] / N``; the least k that keeps it ``<= target`` is
  ``k_under = e_min - 1 - j*`` with ``j* = max{j : cdf[j] <= target N}``;
* the largest entry stays ``<= target_max`` for ``k <= k_over = log2(target_max) - 1 - e_max``
  (``e_max`` the largest exponent seen);
* ``S <- S * 2^min(k_under, k_over)``: the *smallest* scale that meets the underflow target
  (the most headroom against overflow — AdaLoss's choice: the least scale that rescues the
  underflow, bounded by overflow); when both cannot hold, overflow safety wins. S stays a power
  of two times ``init_scale``; k is clamped to ``[-max_shift, max_shift]``.

A non-finite step is skipped and S × backoff_factor (the histogram is discarded). A step whose
observed activation gradients are all zero is read as total underflow: S × growth_factor. Not
attached (nothing observed): S is kept, with one warning — the measured counterpart of AdaLoss's
Gaussian estimate needs the layers. ``stats_every = k``: histograms only in the backwards of
statistic steps, S held in between; ``stats_layers = q``: histograms at a share q of the
boundaries (:mod:`strategies.schedule`). Cost: one exponent histogram (a read of every activation
gradient, ``frexp`` + ``bincount``) per boundary per backward, on the device, no host sync.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from strategies import validation as v
from strategies.base import Strategy
from strategies.boundaries import Boundaries
from strategies.formats import FP16_MIN_NORMAL
from strategies.model_layers import layers
from strategies.params import ScalerParams, hp
from strategies.schedule import StatsSchedule, sampled, stats_step
from strategies.registry import register_strategy
from strategies.scaled_backwards import ScaledBackwards
from strategies.sharding import refuse_flat_params
from strategies.state import State
from strategies.stats import E_BINS, E_LO, GradStats, exponent_histogram

__all__ = ["UnderflowTargetParams", "UnderflowTargetStrategy", "underflow_target_update_"]

def underflow_target_update_(
    scale: torch.Tensor,
    exp_hist: torch.Tensor,
    found_inf: torch.Tensor,
    target: float,
    target_max: float,
    smallest_normal: float,
    growth_factor: float,
    backoff_factor: float,
    max_shift: int,
    observed: bool,
) -> None:
    """The rule, in place on the device (no host sync); clears ``exp_hist`` (float32 counts). The
    Python twin of ``torch.ops.scalelab.underflow_target_update_`` (``cuda/include/rules/underflow_target.h``):
    the counts are summed in double, exactly as long as they are integers below 2^53."""
    h = exp_hist.double()
    n = h.sum()
    bins = torch.arange(E_BINS, device=h.device, dtype=torch.float64) + E_LO
    cdf = h.cumsum(0)
    e_min = math.floor(math.log2(smallest_normal))
    j_star = torch.where(cdf <= target * n, bins, torch.full_like(bins, E_LO - 1)).amax()
    k_under = e_min - 1 - j_star
    e_max = torch.where(h > 0, bins, torch.full_like(bins, E_LO)).amax()
    k_over = math.floor(math.log2(target_max)) - 1 - e_max
    k = torch.minimum(k_under, k_over).clamp(-max_shift, max_shift)
    placed = (scale.double() * torch.exp2(k)).float()
    grown = (scale * growth_factor).float() if observed else scale
    new = torch.where(found_inf != 0, (scale * backoff_factor).float(), torch.where(n > 0, placed, grown))
    scale.copy_(torch.where(torch.isfinite(new) & (new > 0), new, scale))
    exp_hist.zero_()


@dataclass
class UnderflowTargetParams(StatsSchedule, ScalerParams):
    target: float = hp(1e-3, v.between(0.0, 1.0, "[)"), "AdaLoss (Zhao et al. 2019): underflow rate 1e-3",
                       "largest fraction of nonzero activation-gradient entries left below the smallest normal")
    target_max: float = hp(32768.0, v.finite_positive, "seed 003 §4.6", "the largest scaled entry stays at or below")
    smallest_normal: float = hp(FP16_MIN_NORMAL, v.finite_positive, "IEEE fp16 (2^-6 for fp8 e4m3)",
                                "smallest normal value of the activation-gradient format")
    max_shift: int = hp(32, v.integer(1), "scalelab", "largest move of log2 S per update")

    def check(self) -> None:
        super().check()
        if self.target_max <= self.smallest_normal:
            v.fail("target_max", f"> smallest_normal ({self.smallest_normal:g})", self.target_max)


@register_strategy("underflow_target")
class UnderflowTargetStrategy(Strategy):
    """S placed from the on-device exponent histogram of the activation gradients so that at most
    ``target`` of them fall below the smallest normal (module docstring). ``attach(model)``."""

    Params = UnderflowTargetParams
    state_spec = (State("exp_hist", torch.float32, 0.0, saved=False, length=E_BINS, reduce="sum"),)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._handle = None
        self._warned = False
        self._scaled = ScaledBackwards()
        self._boundaries: Boundaries | None = None

    def attach(self, model: torch.nn.Module) -> "UnderflowTargetStrategy":
        """Observe ``model``'s layer boundaries (replacing an earlier attach). Raises
        ``ValueError`` while the model carries another strategy's hooks (``detach()`` that one)."""
        self.detach()
        refuse_flat_params(model, self.name)
        names = layers(model)  # stats_layers: an evenly spread share of them, from the input side
        picked = sampled(len(names), self.params.stats_layers) if names else []
        modules = [model.get_submodule(names[j]) for j in picked] or [model]
        self._boundaries = Boundaries.of(model)
        self._handle = self._boundaries.register("observe", modules, on_grad=self._observe, owner=self)
        return self

    def before_scale(self, outputs: Any) -> None:
        """An attached strategy settles its boundaries on the loss first."""
        if self._handle is not None and isinstance(outputs, (torch.Tensor, list, tuple)):
            self._boundaries.settle(outputs)

    def after_scale(self, scaled: Any) -> Any:
        """An attached strategy observes only the backwards of what :meth:`scale` returns."""
        return scaled if self._handle is None else self._scaled.mark(scaled)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._boundaries = None

    def _observe(self, trace: object, i: int, g: torch.Tensor) -> None:
        if self.state is not None and self._scaled.active() and stats_step(self):  # scaled here; a statistic step
            self.state.exp_hist.add_(exponent_histogram(g).to(self.state.exp_hist))

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        if self._handle is None and not self._warned:
            warnings.warn("underflow_target: not attached (attach(model)) — no activation gradients observed; "
                          "the scale only backs off on overflow", stacklevel=3)
            self._warned = True
        self.run_update("underflow_target_update_", underflow_target_update_, found_inf=found_inf,
                        observed=self._handle is not None)
