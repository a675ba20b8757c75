"""``learned``: log2 S as a learnable scalar, moved every step by Adam on a stated surrogate.

Rule (seed 003, section 3.3 "参数化/学习化缩放因子": treat the scale, or its logarithm, as a
learnable parameter updated by a small optimisation rule from gradient information; "more
flexible in theory, but with extra cost and potential instability"). The parameter is
``theta = log2 S``; it is not stored twice: each :meth:`update` reads ``theta_k = log2 S_k`` from
the scale itself (so ``min_scale``/``max_scale`` clamps, ``update(new_scale)`` and a loaded
``scale`` are what the optimiser continues from) and writes ``S_{k+1} = S_k * 2^(theta_{k+1} -
theta_k)``.

**Surrogate.** From the step's statistics — ``G`` the abs-max of the unscaled gradients, ``u``
the fraction of gradient entries that arrived (scaled) as zero or subnormal
(``(zeros + subnormals) / numel``) — with ``T = target_max`` (32768) and ``lam =
underflow_weight`` (1):

    L(theta) = (theta + log2 G - log2 T)^2 + lam * u(theta),   u(theta) = u_k * 2^-(theta - theta_k)

The first term is zero where the largest scaled gradient ``S * G`` lands on ``T`` (the target of
``max_ema``, seed 003 §3.1); the second is a differentiable proxy of the scaled-gradient
underflow fraction: it is the measured ``u_k`` at the current scale and assumes each doubling of
S halves it (a log-uniform density of magnitudes below the smallest normal). Its gradient at
``theta_k``:

    g_k = dL/dtheta = 2 * (log2(S_k * G) - log2 T) - lam * ln(2) * u_k

so the fixed point sits ``lam * ln2 * u / 2`` octaves above ``T`` (at most 0.35 octave with the
defaults: ``T * 2^0.35 < 65504``, the underflow pull cannot by itself push the abs-max into
overflow). Structural zeros (ReLU, unused rows) are in ``u`` too and add a constant pull.

**Optimiser** (Adam, Kingma & Ba 2015, on the one scalar, in place with torch ops on the state
tensors ``adam_m``, ``adam_v``, ``adam_t``; no ``torch.optim``, no host sync):

    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2;   t <- t + 1
    delta = lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps);   theta <- theta - delta

Defaults ``lr = 1`` (an Adam step is about ``lr`` octaves at most, so one step moves S by at most
about ``x2``, ``max_ema``'s growth cap), ``b1 = 0.9``, ``b2 = 0.999``, ``eps = 1e-8`` (Adam's).

**Other branches.**

* Non-finite gradients: hard skip + backoff, ``S <- S * backoff_factor``; the first moment is
  reset (``m <- 0``: the momentum that drove S into the overflow is dropped, otherwise it keeps
  pushing S up into the next one), the second moment and the step count are kept (they still
  describe the gradient scale; resetting ``t`` would make the next step a full-``lr`` one again).
  The growth tracker restarts.
* All-zero gradients (``G = 0``: total underflow, ``log2 G`` undefined): no Adam step (the state
  is untouched) and ``S <- S * growth_factor``, as ``max_ema``'s ``zero_grads="grow"``.
* ``growth_interval`` (default 1 = off): as ``max_ema``, upward moves wait until that many finite
  steps in a row were seen; downward moves are never delayed.
* A new S that is not finite or not > 0 is rejected (S kept).

**Instability, kept visible.** Adam normalises the step by ``sqrt(v)``, a long (b2 = 0.999)
memory of past gradient sizes: after a long climb, steps near the target are small and the rule
settles (the overflow-plus-``m``-reset acts as a brake); started *near* the target, where ``v``
is small, each step is about ``lr`` octaves whatever the gradient, so with ``lr`` above the
headroom ``log2(format_max / target_max)`` (1 octave) it oscillates across the overflow boundary,
skipping steps (tested with a large ``lr``, not tuned away). ``telemetry()`` reports
``log2_scale``, ``surrogate_loss``, ``surrogate_grad``, ``underflow_frac`` and the Adam state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strategies import kernels
from strategies import validation as v
from strategies.base import Strategy
from strategies.formats import FP16_MAX
from strategies.params import ScalerParams, hp
from strategies.schedule import StatsSchedule
from strategies.registry import register_strategy
from strategies.state import State
from strategies.stats import GradStats

__all__ = ["LEARNED_STATE", "LN2", "LearnedParams", "LearnedStrategy", "learned_hparams", "learned_update_"]

LN2 = math.log(2.0)


@dataclass
class LearnedParams(StatsSchedule, ScalerParams):
    init_scale: float = hp(2.0**15, v.finite_positive, "seed 003 §4.6 (max scaling's start; as max_ema)")
    growth_interval: int = hp(1, v.integer(1), "scalelab", "finite steps after an overflow before S may rise again")
    target_max: float = hp(32768.0, v.finite_positive, "seed 003 §4.6", "T: where the surrogate puts S * absmax")
    format_max: float = hp(FP16_MAX, v.finite_positive, "IEEE fp16", "largest finite value of the gradient format")
    underflow_weight: float = hp(1.0, v.between(0.0, math.inf, "[)"), "scalelab",
                                 "lam: weight of the underflow-fraction proxy in the surrogate")
    lr: float = hp(1.0, v.finite_positive, "scalelab", "Adam's step size on log2 S (about octaves per step)")
    beta1: float = hp(0.9, v.between(0.0, 1.0, "[)"), "Kingma & Ba 2015", "Adam's first-moment decay")
    beta2: float = hp(0.999, v.between(0.0, 1.0, "[)"), "Kingma & Ba 2015", "Adam's second-moment decay")
    eps: float = hp(1e-8, v.finite_positive, "Kingma & Ba 2015", "Adam's denominator floor")

    def check(self) -> None:
        super().check()
        if self.target_max > self.format_max:
            v.fail("target_max", f"<= format_max ({self.format_max:g})", self.target_max)


LEARNED_STATE = (
    State("adam_m", torch.float32, 0.0),
    State("adam_v", torch.float32, 0.0, low=0.0),
    State("adam_t", torch.int32, 0, low=0),
    State("log2_scale", torch.float32, math.nan, saved=False),
    State("surrogate_loss", torch.float32, math.nan, saved=False),
    State("surrogate_grad", torch.float32, math.nan, saved=False),
    State("underflow_frac", torch.float32, math.nan, saved=False),
)


def learned_update_(
    scale: torch.Tensor, growth_tracker: torch.Tensor, adam_m: torch.Tensor, adam_v: torch.Tensor,
    adam_t: torch.Tensor, log2_scale: torch.Tensor, surrogate_loss: torch.Tensor, surrogate_grad: torch.Tensor,
    underflow_frac: torch.Tensor, found_inf: torch.Tensor, grad_absmax: torch.Tensor, underflow: torch.Tensor,
    target_max: float, underflow_weight: float, lr: float, beta1: float, beta2: float, eps: float,
    growth_factor: float, backoff_factor: float, growth_interval: int,
) -> None:
    """The learned rule, in place on the device (no host sync); the Python twin of
    ``torch.ops.scalelab.learned_update_`` (``cuda/include/rules/learned.h``). Scalar tensors
    but ``grad_absmax``.

    log2, exp2 and sqrt are evaluated in double and rounded once to float32
    (:func:`strategies.kernels.f32_of_double`), the bias corrections ``1 - beta^t`` in double, as
    the rule header computes them on every device; every other op is one float32 rounding.

    Args:
        scale: float32 S (theta = log2 S is read from it); growth_tracker: int32, consecutive
            finite steps saturating at ``growth_interval``.
        adam_m, adam_v: float32 Adam moments; adam_t: int32 Adam step count.
        log2_scale, surrogate_loss, surrogate_grad, underflow_frac: float32, written for
            telemetry (the new theta; L, g and u of this step where it fed Adam).
        found_inf: float32, > 0 when the step's gradients were non-finite.
        grad_absmax: float32 abs-max per group (``[G]``; their max is G); underflow: float32 u,
            this step's (zeros + subnormals) / numel.
        other arguments: the hyper-parameters (:class:`LearnedParams`, in the order of
            :func:`learned_hparams`; the maths in the module docstring).
    """
    f32_of_double = kernels.f32_of_double
    grad_absmax = grad_absmax.amax()
    found = found_inf != 0
    fed = ~found & (grad_absmax > 0)
    u = underflow.to(torch.float32)
    d = f32_of_double(torch.log2, scale) + f32_of_double(torch.log2, grad_absmax) - math.log2(target_max)
    loss = d * d + underflow_weight * u
    g = torch.where(fed, 2.0 * d - (underflow_weight * LN2) * u, torch.zeros_like(d))

    m = beta1 * adam_m + (1.0 - beta1) * g
    v_ = beta2 * adam_v + (1.0 - beta2) * g * g
    t = adam_t + 1
    tf = t.to(torch.float64)  # bias corrections in double: 1 - 0.999^t loses 1e-5 relative in float
    m_hat = m / (1.0 - torch.pow(beta1, tf)).to(torch.float32)
    v_hat = v_ / (1.0 - torch.pow(beta2, tf)).to(torch.float32)
    delta = lr * m_hat / (f32_of_double(torch.sqrt, v_hat) + eps)

    tracker = torch.where(found, torch.zeros_like(growth_tracker),
                          torch.clamp(growth_tracker + 1, max=growth_interval))
    may_grow = tracker >= growth_interval
    delta = torch.where(may_grow, delta, delta.clamp(min=0.0))  # theta - delta rises only if allowed
    up = torch.where(may_grow, scale * growth_factor, scale)
    new = torch.where(found, scale * backoff_factor,
                      torch.where(fed, scale * f32_of_double(torch.exp2, -delta), up)).to(torch.float32)
    new = torch.where(torch.isfinite(new) & (new > 0), new, scale)

    adam_m.copy_(torch.where(found, torch.zeros_like(m), torch.where(fed, m, adam_m)))
    adam_v.copy_(torch.where(fed, v_, adam_v))
    adam_t.copy_(torch.where(fed, t, adam_t))
    surrogate_loss.copy_(torch.where(fed, loss, torch.full_like(loss, math.nan)))
    surrogate_grad.copy_(torch.where(fed, g, torch.full_like(g, math.nan)))
    underflow_frac.copy_(u)
    growth_tracker.copy_(tracker)
    scale.copy_(new)
    log2_scale.copy_(f32_of_double(torch.log2, new))


def learned_hparams(p: LearnedParams) -> tuple:
    """The hyper-parameter arguments of :func:`learned_update_` (after ``underflow``), from ``p``."""
    return (p.target_max, p.underflow_weight, p.lr, p.beta1, p.beta2, p.eps, p.growth_factor, p.backoff_factor,
            p.growth_interval)


@register_strategy("learned")
class LearnedStrategy(Strategy):
    """Learned scale: ``log2 S`` is moved every step by Adam on the surrogate
    ``(log2(S * absmax) - log2 target_max)^2 + underflow_weight * underflow-fraction proxy``;
    non-finite steps are skipped and backed off (seed 003 §3.3; maths in the module docstring).
    Can oscillate with a large ``lr`` — by design of the family, kept visible."""

    Params = LearnedParams
    state_spec = LEARNED_STATE
    needs_stats = True

    def update_(self, found_inf: torch.Tensor, stats: GradStats | None) -> None:
        assert stats is not None
        self.run_update("learned_update_", learned_update_, found_inf=found_inf, grad_absmax=stats.absmax,
                        underflow=stats.fraction(stats.zeros, stats.subnormals))
