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
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["adaloss_update_", "record_", "weight_stats"]


@functools.lru_cache(maxsize=8)
def _erfinv(y: float) -> float:
    """erfinv by bisection on math.erf (host; cached: the rate is a hyper-parameter, so this runs
    once per value, not once per update; no scipy in the library)."""
    lo, hi = 0.0, 6.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def record_(g2: torch.Tensor, n: torch.Tensor, gmax: torch.Tensor, group: int, grad: torch.Tensor,
            scale: torch.Tensor) -> None:
    """Accumulate, for ``group``, the sum of squares, count and abs-max of ``grad / scale``."""
    g = grad.detach().float() / scale
    g2[group] += g.square().sum()
    n[group] += g.numel()
    gmax[group] = torch.maximum(gmax[group], g.abs().amax())


def weight_stats(groups: list[list[torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per group: mean of the squared weights, their abs-max and the fan (largest ``shape[0]``)
    over the weight matrices (dim >= 2); groups without one get (1, 1, 1)."""
    w2, wmax, fan = [], [], []
    for ws in groups:
        mats = [w.detach().float() for w in ws if w.dim() >= 2]
        if not mats:
            w2.append(torch.ones((), device=device))
            wmax.append(torch.ones((), device=device))
            fan.append(1.0)
            continue
        total = sum(m.numel() for m in mats)
        w2.append(torch.stack([m.square().sum() for m in mats]).sum().to(device) / total)
        wmax.append(torch.stack([m.abs().amax() for m in mats]).amax().to(device))
        fan.append(float(max(m.shape[0] for m in mats)))
    return torch.stack(w2), torch.stack(wmax), torch.tensor(fan, device=device)


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
    t = math.sqrt(2.0) * _erfinv(underflow_rate)
    sigma = (g2 / n.clamp(min=1) * w2).sqrt()
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
    skip = found_inf > 0
    backed = (scales * backoff_factor).float()
    scales.copy_(torch.where(skip, torch.where(blamed, backed, scales), new))
