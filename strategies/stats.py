"""One pass over the gradients: unscale in place and gather the statistics every strategy uses.

For gradients ``g`` in groups ``l = 0..G-1`` with inverse scales ``inv_l`` this computes, per
group, on the gradients' device and without any host synchronisation:

* ``g <- g * inv_l`` in place, in float arithmetic cast back to ``g``'s dtype, skipped when
  ``inv_l == 1`` — exactly ``torch._amp_foreach_non_finite_check_and_unscale_``, so a strategy
  built on it stays bit-identical to ``torch.amp.GradScaler``;
* ``found_inf_l``  = 1.0 if any element is NaN or ±Inf, else 0.0;
* ``absmax_l``     = max |g * inv_l| (NaN/Inf propagate; a strategy never feeds a non-finite step);
* ``sumsq_l``      = sum (g * inv_l)^2  (so the L2 norm is ``sqrt(sum_l sumsq_l)``);
* ``zeros_l``      = #{g == 0} and ``subnormals_l`` = #{0 < |g| < 2^-14} — counted on the values
  *as they arrived* (scaled), because that is where the fp16 range decides what survives;
* ``numel_l``.

:func:`unscale_and_stats` uses the fused kernel from ``cuda/`` when it is built (CPU twin or
CUDA), else :func:`unscale_and_stats_reference`, the plain-torch multi-pass version that is also
the oracle of the kernel tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
import torch.distributed as dist

from strategies import kernels
from strategies.formats import FP16_MIN_NORMAL

__all__ = [
    "E_BINS", "E_LO", "GradStats", "bin_counts", "count_fraction", "count_fraction_reference", "exponent_histogram",
    "extremes", "extremes_reference", "exponent_histogram_reference", "nonfinite", "fold_histogram", "unscale_and_check", "unscale_and_stats", "unscale_and_stats_reference", "zeros_and_subnormals",
]


@dataclass
class GradStats:
    """Per-group gradient statistics; every field is a device tensor of shape ``[G]``."""

    found_inf: torch.Tensor  # float32
    absmax: torch.Tensor  # float32
    sumsq: torch.Tensor  # float32
    zeros: torch.Tensor  # int64
    subnormals: torch.Tensor  # int64
    numel: torch.Tensor  # int64

    @staticmethod
    def empty(num_groups: int, device: torch.device | str) -> "GradStats":
        f = dict(dtype=torch.float32, device=device)
        i = dict(dtype=torch.int64, device=device)
        return GradStats(
            torch.zeros(num_groups, **f),
            torch.zeros(num_groups, **f),
            torch.zeros(num_groups, **f),
            torch.zeros(num_groups, **i),
            torch.zeros(num_groups, **i),
            torch.zeros(num_groups, **i),
        )

    def to(self, device: torch.device) -> "GradStats":
        return GradStats(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))

    def combine(self, other: "GradStats") -> "GradStats":
        """Statistics of the union of two disjoint gradient sets (other optimizers or devices)."""
        return GradStats(
            torch.maximum(self.found_inf, other.found_inf),
            torch.maximum(self.absmax, other.absmax),
            self.sumsq + other.sumsq,
            self.zeros + other.zeros,
            self.subnormals + other.subnormals,
            self.numel + other.numel,
        )

    def all_reduce(self, mode: str) -> "GradStats":
        """The statistics of every rank, the same on all ranks (one or two collectives, no sync).

        ``mode="replicated"`` (DDP: every rank holds the full gradient): MAX over ranks for every
        field, so ranks agree even if one saw an Inf the others did not. ``mode="sharded"``
        (FSDP/ZeRO: disjoint shards): MAX for ``found_inf``/``absmax``, SUM for the sums and counts.
        Every rank must call it, also one that holds no gradient (pass :meth:`empty`).
        """
        g = self.found_inf.numel()
        if mode == "replicated":
            packed = torch.cat([getattr(self, f.name).double() for f in fields(self)])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            parts = packed.split(g)
            return GradStats(*(p.to(getattr(self, f.name).dtype) for p, f in zip(parts, fields(self))))
        if mode != "sharded":
            raise ValueError(f"mode must be 'replicated' or 'sharded', got {mode!r}")
        peak = torch.cat([self.found_inf, self.absmax])
        summed = torch.cat([self.sumsq.double(), self.zeros.double(), self.subnormals.double(), self.numel.double()])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        p, s = peak.split(g), summed.split(g)
        return GradStats(p[0], p[1], s[0].float(), s[1].long(), s[2].long(), s[3].long())

    def fraction(self, counts: torch.Tensor, more: torch.Tensor | None = None) -> torch.Tensor:
        """``(sum(counts) + sum(more)) / sum(numel)`` over the groups as a float32 scalar (0
        without entries), divided in double: the zero or underflow fraction of the whole step
        (:func:`count_fraction`; :meth:`total` reduces every field)."""
        return count_fraction(self.numel, counts, more)

    def total(self) -> "GradStats":
        """Reduce over groups: every field becomes shape ``[1]``."""
        return GradStats(
            self.found_inf.amax(0, keepdim=True),
            self.absmax.amax(0, keepdim=True),
            self.sumsq.sum(0, keepdim=True),
            self.zeros.sum(0, keepdim=True),
            self.subnormals.sum(0, keepdim=True),
            self.numel.sum(0, keepdim=True),
        )


E_LO, E_BINS = -150, 280  # exponent bins floor(log2|g|) = -150 .. 129 cover every float32 value


def extremes(g: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``g``'s entries in float64 (NaN propagates; ``[0, 0]`` when empty), on
    ``g``'s device, no sync, that :func:`nonfinite` and AdaLoss's abs-max
    (:func:`strategies.rules.adaloss.record_`) share at a layer boundary: one pass of
    ``torch.ops.scalelab.grad_extremes`` where it applies (:func:`strategies.kernels.boundary_applies`),
    else :func:`extremes_reference`."""
    g = g.detach()
    if kernels.boundary_applies("grad_extremes", g):
        return torch.ops.scalelab.grad_extremes(g)
    return extremes_reference(g)


def extremes_reference(g: torch.Tensor) -> torch.Tensor:
    """:func:`extremes` in plain torch: two vectorised reductions (the oracle of the op)."""
    if g.numel() == 0:  # host metadata, no sync
        return torch.zeros(2, dtype=torch.float64, device=g.device)
    g = g.detach()
    return torch.stack((g.amin(), g.amax())).double()


def nonfinite(ext: torch.Tensor) -> torch.Tensor:
    """1.0 if the entries whose :func:`extremes` are ``ext`` (or each row of a stack of them)
    hold an Inf or NaN, else 0.0 (float32): ``max - min`` in float64 is finite exactly when both are (no float32/16
    difference overflows float64; +inf with +inf gives NaN). ``torch.isfinite(g).any()`` says the
    same with an unvectorised CPU loop and a temporary the size of ``g``."""
    d = ext[..., 1] - ext[..., 0]
    return (d - d).ne(0).float()


def exponent_histogram(g: torch.Tensor) -> torch.Tensor:
    """Counts of ``floor(log2|g|)`` over the nonzero finite entries of ``g`` (bin i: exponent
    E_LO + i), int64 ``[E_BINS]``: one pass of ``torch.ops.scalelab.exponent_histogram`` where it
    applies (:func:`strategies.kernels.boundary_applies`), else :func:`exponent_histogram_reference`."""
    g = g.detach()
    if kernels.boundary_applies("exponent_histogram", g):
        return torch.ops.scalelab.exponent_histogram(g)
    return exponent_histogram_reference(g)


def exponent_histogram_reference(g: torch.Tensor) -> torch.Tensor:
    """:func:`exponent_histogram` in plain torch (the oracle of the op).

    Read off the bits, elementwise, and one count; no boolean indexing (which reads its length on
    the host: a sync on CUDA). Every float32 value, subnormals included, is a *normal* float64,
    so ``floor(log2|g|)`` is the float64 exponent field ``(bits >> 52) & 0x7FF`` minus its bias
    1023: exponents -149 .. 127 land in bins 1 .. 277. Zero has the field 0 and +-inf/NaN 0x7FF;
    shifted by ``E_LO + 1023`` and clamped to ``[0, E_BINS]`` they fall in bin 0 (no float32
    exponent is -150, so the bin is emptied) and in the extra bin ``E_BINS`` (dropped). Equal bit
    for bit to ``frexp`` of the selected entries (tests/strategies/test_underflow_target.py), in
    fewer and cheaper passes (int16 indices: the CPU's bincount is the cost)."""
    field = (g.detach().reshape(-1).double().view(torch.int64) >> 52).to(torch.int16) & 0x7FF
    idx = (field - (E_LO + 1023)).clamp_(0, E_BINS)
    counts = bin_counts(idx, sync_free=idx.device.type != "cpu")[:E_BINS]
    counts[0] = 0
    return counts


def bin_counts(idx: torch.Tensor, sync_free: bool) -> torch.Tensor:
    """``bincount(idx, minlength=E_BINS + 1)`` for indices in [0, E_BINS]; ``sync_free``: by
    ``scatter_add_`` instead (CUDA's bincount reads ``idx.max()`` on the host; the CPU's is faster)."""
    if not sync_free:
        return torch.bincount(idx, minlength=E_BINS + 1)
    one = torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel())
    return torch.zeros(E_BINS + 1, dtype=torch.int64, device=idx.device).scatter_add_(0, idx.long(), one)


def fold_histogram(counts: torch.Tensor, lo: int, bins: int) -> torch.Tensor:
    """An :func:`exponent_histogram` (exponents ``E_LO ..``) folded onto ``bins`` bins from
    exponent ``lo``: exponents below ``lo`` count in the first bin, above ``lo + bins - 1`` in the last."""
    target = (torch.arange(E_BINS, device=counts.device) + (E_LO - lo)).clamp_(0, bins - 1)
    return torch.zeros(bins, dtype=counts.dtype, device=counts.device).index_add_(0, target, counts)


def zeros_and_subnormals(grads: Sequence[torch.Tensor],
                          smallest_normal: float = FP16_MIN_NORMAL) -> tuple[torch.Tensor, torch.Tensor]:
    """``(#{g == 0}, #{0 < |g| < smallest_normal})`` over every entry of ``grads``: two int64
    scalars on the gradients' device (no host read). Each comparison is made in the gradient's own
    dtype (the threshold, 2^-14 for fp16, is exact in every float format that has it as a normal
    value). NaN counts in neither; ``-0.0`` is a zero. The subnormal count is ``#{|g| <
    smallest_normal} - #{g == 0}``, which equals ``#{g != 0 and |g| < smallest_normal}`` exactly."""
    zeros = torch.stack([(g == 0).sum() for g in grads]).sum()
    tiny = torch.stack([(g.abs() < smallest_normal).sum() for g in grads]).sum()
    return zeros, tiny - zeros


def count_fraction_reference(numel: torch.Tensor, counts: torch.Tensor, more: torch.Tensor | None = None) -> torch.Tensor:
    """``(sum(counts) + sum(more)) / max(sum(numel), 1)``, the sums in int64, divided in double
    and rounded once to float32: the oracle of ``torch.ops.scalelab.count_fraction``."""
    c = counts.sum() if more is None else (counts + more).sum()
    return (c / numel.sum().clamp(min=1).double()).float()


def count_fraction(numel: torch.Tensor, counts: torch.Tensor, more: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`count_fraction_reference`, as one op when the extension is built (a rule pays it every
    step: one op instead of six)."""
    tensors = (numel, counts) if more is None else (numel, counts, more)
    if kernels.update_applies("count_fraction", tensors):
        return torch.ops.scalelab.count_fraction(numel, counts, more)
    return count_fraction_reference(numel, counts, more)


def _group_lists(
    grads: Sequence[torch.Tensor], group_index: Sequence[int] | None, num_groups: int
) -> list[list[torch.Tensor]]:
    if group_index is None:
        group_index = [0] * len(grads)
    if len(group_index) != len(grads):
        raise ValueError(
            f"group_index must have one entry per gradient ({len(grads)}), got {len(group_index)}"
        )
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
    for g, gi in zip(grads, group_index):
        if not 0 <= gi < num_groups:
            raise ValueError(f"group_index entries must be in [0, {num_groups}), got {gi}")
        groups[gi].append(g)
    return groups


def _per_group_inv(inv_scale: torch.Tensor, num_groups: int) -> torch.Tensor:
    inv = inv_scale.reshape(-1)
    if inv.numel() == 1:
        return inv.expand(num_groups)
    if inv.numel() != num_groups:
        raise ValueError(f"inv_scale must have 1 or {num_groups} elements, got {inv.numel()}")
    return inv


def unscale_and_stats_reference(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    group_index: Sequence[int] | None = None,
    num_groups: int = 1,
) -> GradStats:
    """Plain-torch multi-pass implementation of the statistics contract (the oracle)."""
    device = inv_scale.device
    out = GradStats.empty(num_groups, device)
    inv = _per_group_inv(inv_scale, num_groups)
    with torch.no_grad():
        for gi, gs in enumerate(_group_lists(grads, group_index, num_groups)):
            gs = [g for g in gs if g.numel() > 0]
            if not gs:
                continue
            # Counts first: they describe the values as backward produced them.
            out.zeros[gi], out.subnormals[gi] = zeros_and_subnormals(gs)
            out.numel[gi] = sum(g.numel() for g in gs)
            _non_finite_check_and_unscale_(gs, out.found_inf[gi], inv[gi])
            absmax = torch.stack(torch._foreach_norm(gs, float("inf"))).float().amax()
            # Half-precision norms accumulate in float32; float32/float64 ones in their own dtype.
            half = [g for g in gs if g.dtype in (torch.float16, torch.bfloat16)]
            wide = [g for g in gs if g.dtype not in (torch.float16, torch.bfloat16)]
            norms = []
            if half:
                norms += torch._foreach_norm(half, 2, dtype=torch.float32)
            if wide:
                norms += [n.float() for n in torch._foreach_norm(wide, 2)]
            norms = torch.stack(norms)
            out.absmax[gi] = absmax
            out.sumsq[gi] = norms.square().sum()
    return out


def unscale_and_stats(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    group_index: Sequence[int] | None = None,
    num_groups: int = 1,
) -> GradStats:
    """Unscale ``grads`` in place by their group's ``inv_scale`` and return :class:`GradStats`.

    ``inv_scale`` is a float32 tensor of shape ``[]`` or ``[num_groups]`` on the gradients'
    device; ``group_index[i]`` is the group of ``grads[i]`` (all in group 0 when omitted).
    Runs the fused kernel (``torch.ops.scalelab.unscale_and_stats``) when it is built and applies
    to these gradients, else :func:`unscale_and_stats_reference`.
    """
    fused = kernels.unscale_and_stats(grads, inv_scale, group_index, num_groups)
    if fused is not None:
        return GradStats(*fused)
    return unscale_and_stats_reference(grads, inv_scale, group_index, num_groups)


def unscale_and_check(
    grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """The found-inf-only path (no statistics): torch's own op, for strategies that need none
    (bfloat16 CUDA gradients: the same arithmetic in plain torch, see below)."""
    with torch.no_grad():
        _non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)


_MANUAL_BF16_DEVICES: tuple[str, ...] = ("cuda",)
"""Device types whose bfloat16 gradients bypass ``torch._amp_foreach_non_finite_check_and_unscale_``:
torch implements it on CUDA for float, double and half only (pytorch issue 127176). Tests add
``"cpu"`` to check the manual path bit for bit against torch's CPU op."""


def _non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``, with bfloat16 gradients on the
    devices of :data:`_MANUAL_BF16_DEVICES` done in plain torch with the op's arithmetic:
    ``found_inf <- 1`` if any *arrived* value is NaN/Inf, then ``g <- bf16(float(g) * inv)`` (one
    float32 product, rounded to nearest even), ``g`` untouched where ``inv == 1``. No host sync
    (``inv == 1`` is decided on the device)."""
    manual = [g for g in grads if g.dtype == torch.bfloat16 and g.device.type in _MANUAL_BF16_DEVICES]
    rest = [g for g in grads if not (g.dtype == torch.bfloat16 and g.device.type in _MANUAL_BF16_DEVICES)]
    if rest:
        torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, inv_scale)
    if not manual:
        return
    inv = inv_scale.reshape(())
    bad = torch.stack([(~torch.isfinite(g)).any() for g in manual]).any()
    found_inf.masked_fill_(bad, 1.0)
    keep = inv == 1
    for g in manual:
        g.copy_(torch.where(keep, g, (g.float() * inv).to(torch.bfloat16)))
