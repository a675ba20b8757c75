"""AdaLoss for ``layerwise`` (``rule: adaloss``): each group's scale from its gradient and weight
statistics (Zhao et al. 2019, arXiv 1910.12385; reference code kumasento/gradient-scaling,
``ada_loss/chainer_impl/ada_loss.py``: ``get_loss_scale_by_approx_range`` and
``bound_loss_scale_by_heuristics``).

For a layer whose backward multiplies the incoming activation gradient ``g`` by its weights ``W``,
AdaLoss treats the products ``g w`` as zero-mean with variance ``E[g^2] E[w^2]`` and picks the
scale that leaves a fraction ``n_uf`` (1e-3) of them below the format's smallest value ``u_min``
(6e-8 for fp16): ``u_min / (t sigma)`` with ``t = sqrt(2) erfinv(n_uf)`` (the normal quantile),
at least 1, at most ``(u_max / fan) / max|g w|`` (no overflow in the accumulation over ``fan``
products, ``u_max`` = 65504), at most ``accum_upper_bound / prev_scale`` (1024 cumulative) and at
most ``scale_upper_bound`` (16 per layer), rounded down to a power of two. Scales multiply from
the loss downwards: the loss-side group's ``prev_scale`` is 1, and group l's cumulative scale is
``S_l = S_{l+1} * f_l``.

Here a group's ``g`` is the gradient arriving at its output (recorded unscaled, on the device, by
:func:`record_`), its ``W`` the group's weight matrices (tensors of dimension >= 2; ``fan`` their
largest ``shape[0]``, the length of the backward's accumulation). On a skipped step the groups
where the overflow originated back off (``layerwise``'s attribution) and the others keep S.

``stats_every = k`` is the reference's ``update_per_n_iteration`` (default 1; its CIFAR example
recommends 1000): the scales and the weight statistics are recomputed on every k-th update only.
The weight read is what this rule costs over ``layerwise`` (docs/kernels.md).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import DTensor

from strategies.host_index import host_tensor
from strategies.kernels import f32_of_double
from strategies.layer_groups import overflow_origin
from strategies.sharding import all_reduce_, local
from strategies.stats import unscale_and_stats

__all__ = ["WeightStats", "adaloss_step_", "adaloss_update_", "observe", "quantile", "record_"]


@functools.lru_cache(maxsize=8)
def _erfinv(y: float) -> float:
    """erfinv by bisection on math.erf (host; cached: the rate is a hyper-parameter, so this runs
    once per value, not once per update; no scipy in the library)."""
    lo, hi = 0.0, 6.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def quantile(underflow_rate: float) -> float:
    """``t = sqrt(2) erfinv(n_uf)``: the normal quantile that leaves ``n_uf`` of the products below
    ``u_min`` (host, double; the op and the twin take it as an argument)."""
    return math.sqrt(2.0) * _erfinv(underflow_rate)


def observe(grad: torch.Tensor, ext: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """What :func:`record_` needs of one gradient arriving at a group's output: its sum of squares
    (one ``dot``), its size and its :func:`strategies.stats.extremes` ``ext`` (read by the caller)."""
    g = grad.detach().reshape(-1).float()
    return torch.dot(g, g), g.numel(), ext


def record_(g2: torch.Tensor, n: torch.Tensor, gmax: torch.Tensor, scales: torch.Tensor,
            seen: list[tuple[int, int, tuple[torch.Tensor, int, torch.Tensor]]]) -> None:
    """Accumulate, per group a, the sum of squares, count and abs-max of ``grad / S_b`` over the
    gradients ``seen`` as ``(a, b, observe(grad, ...))`` (b: the group whose scale the gradient
    carries), in one go for a step's crossings. The scales are powers of two, so these are the
    gradient's own times ``1/S_b^2`` and ``1/S_b`` (exact, but where an entry's square leaves
    float32's range)."""
    if not seen:
        return
    dev = g2.device
    a = host_tensor(tuple(x[0] for x in seen), torch.int64, dev)
    inv = scales.index_select(0, host_tensor(tuple(x[1] for x in seen), torch.int64, dev)).reciprocal()
    sq, size, ext = zip(*(x[2] for x in seen))
    g2.index_add_(0, a, torch.stack(sq) * (inv * inv))
    n.index_add_(0, a, host_tensor(size, n.dtype, dev))
    gmax.scatter_reduce_(0, a, (torch.stack(ext).abs().amax(1) * inv).float(), "amax")


class WeightStats:
    """Per group: mean of the squared weights, their abs-max and the fan (largest ``shape[0]``)
    over the weight matrices (dim >= 2); groups without one get (1, 1, 1). What depends only on
    the groups (matrices, group ids, counts, fans) is built once; each call reads the matrices once
    (:func:`strategies.stats.unscale_and_stats` at inverse scale 1, which writes nothing: per group
    the sum of squares and the abs-max), sharded ones (FSDP2) twice (``_foreach_norm`` 2 and inf,
    then reduced over ranks)."""

    def __init__(self, groups: list[list[torch.Tensor]], device: torch.device) -> None:
        mats = [(gi, w) for gi, ws in enumerate(groups) for w in ws if w.dim() >= 2]
        G = len(groups)
        # FSDP2 (DTensor weights): each rank reads its shards; the sums and maxima are reduced over ranks
        self.sharded = any(isinstance(w, DTensor) for _, w in mats)
        self.tensors = [local(w) for _, w in mats]
        self.gid = torch.tensor([gi for gi, _ in mats], dtype=torch.int64, device=device)
        count, fan = [0.0] * G, [0.0] * G
        for gi, w in mats:
            count[gi] += w.numel()
            fan[gi] = max(fan[gi], float(w.shape[0]))
        self.count = torch.tensor(count, device=device)
        self.has = self.count > 0
        self.fan = torch.tensor([f if f > 0 else 1.0 for f in fan], device=device)
        self.ones = torch.ones(G, device=device)
        self.groups = [gi for gi, _ in mats]
        self.one = torch.ones((), device=self.tensors[0].device) if self.tensors else self.ones

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.tensors:
            return self.ones, self.ones, self.fan
        with torch.no_grad():
            dev = self.ones.device
            if self.sharded:  # norms: a shard may be empty
                sq = torch.stack(torch._foreach_norm(self.tensors, 2)).float().to(dev).square()
                mx = torch.stack(torch._foreach_norm(self.tensors, float("inf"))).float().to(dev)
                all_reduce_([sq], "sum")
                all_reduce_([mx], "max")
                w2 = torch.zeros_like(self.ones).index_add_(0, self.gid, sq) / self.count.clamp(min=1)
                wmax = torch.zeros_like(self.ones).scatter_reduce_(0, self.gid, mx, "amax")
            else:  # per group, sum of squares and abs-max in one read (at scale 1 the pass writes nothing)
                st = unscale_and_stats(self.tensors, self.one, self.groups, len(self.ones))
                w2, wmax = st.sumsq.to(dev) / self.count.clamp(min=1), st.absmax.to(dev)
        return torch.where(self.has, w2, self.ones), torch.where(self.has, wmax, self.ones), self.fan


def adaloss_update_(
    scales: torch.Tensor,
    blamed: torch.Tensor,
    found_inf: torch.Tensor,
    g2: torch.Tensor,
    n: torch.Tensor,
    gmax: torch.Tensor,
    w2: torch.Tensor,
    wmax: torch.Tensor,
    fan: torch.Tensor,
    underflow_rate: float,
    u_min: float,
    u_max: float,
    layer_cap: float,
    total_cap: float,
    backoff_factor: float,
) -> None:
    """AdaLoss's scales for groups 0..G-1 (G-1 nearest the loss), in place, no host sync.

    ``blamed`` (bool [G]): the groups an overflow is attributed to on a skipped step."""
    _scales_(scales, blamed, found_inf, g2, n, gmax, w2, wmax, fan, quantile(underflow_rate), u_min, u_max,
             layer_cap, total_cap, backoff_factor)


def _scales_(scales: torch.Tensor, blamed: torch.Tensor, found_inf: torch.Tensor, g2: torch.Tensor,
             n: torch.Tensor, gmax: torch.Tensor, w2: torch.Tensor, wmax: torch.Tensor, fan: torch.Tensor,
             t: float, u_min: float, u_max: float, layer_cap: float, total_cap: float,
             backoff_factor: float) -> None:
    """:func:`adaloss_update_` with the quantile ``t`` given: the float32 arithmetic of
    ``cuda/include/rules/adaloss.h`` (sqrt correctly rounded there and here)."""
    sigma = f32_of_double(torch.sqrt, g2 / n.clamp(min=1) * w2)
    wanted = torch.where(sigma > 0, u_min / (t * sigma), torch.ones_like(sigma))
    upper = torch.where(gmax * wmax > 0, (u_max / fan) / (gmax * wmax), torch.full_like(sigma, math.inf))
    new = torch.empty_like(scales)
    prev = torch.ones((), dtype=scales.dtype, device=scales.device)
    for layer in range(scales.numel() - 1, -1, -1):  # from the loss downwards
        f = torch.clamp(wanted[layer], min=1.0)
        f = torch.minimum(torch.minimum(f, upper[layer]), torch.minimum(total_cap / prev, torch.tensor(layer_cap)))
        _, e = torch.frexp((prev * f).float())
        new[layer] = torch.ldexp(torch.ones_like(prev), e - 1)  # round down to a power of two
        prev = new[layer]
    skip = found_inf != 0
    backed = (scales * backoff_factor).float()
    scales.copy_(torch.where(skip, torch.where(blamed, backed, scales), new))


def adaloss_step_(
    scales: torch.Tensor, origin: torch.Tensor, g2: torch.Tensor, n: torch.Tensor, gmax: torch.Tensor,
    found_inf: torch.Tensor, group_found_inf: torch.Tensor, emitted: torch.Tensor, contaminated: torch.Tensor,
    w2: torch.Tensor, wmax: torch.Tensor, fan: torch.Tensor, quantile: float, u_min: float, u_max: float,
    layer_cap: float, total_cap: float, backoff_factor: float, min_scale: float | None, max_scale: float | None,
) -> None:
    """One update of ``layerwise`` with ``rule: adaloss``, in place, no host sync: the groups an
    overflow is blamed on (:func:`strategies.layer_groups.overflow_origin`), :func:`adaloss_update_`
    with the normal ``quantile`` (:func:`quantile`), the scales clamped to the power-of-two bounds
    ``[min_scale, max_scale]`` where given, ``origin`` set to the blame, and the hooks' statistics
    ``g2``, ``n``, ``gmax`` cleared for the next step. The Python twin of
    ``torch.ops.scalelab.adaloss_step_`` (all tensors float32 ``[G]``, ``found_inf`` a scalar)."""
    blamed = overflow_origin(found_inf, group_found_inf, emitted, contaminated)
    _scales_(scales, blamed, found_inf, g2, n, gmax, w2, wmax, fan, quantile, u_min, u_max, layer_cap, total_cap,
             backoff_factor)
    if min_scale is not None or max_scale is not None:
        scales.clamp_(min=min_scale, max=max_scale)
    origin.copy_(blamed)
    for t in (g2, n, gmax):
        t.zero_()
