"""Every rank holds the same scaler state before its collectives pair up.

Under a process group each rank runs its own copy of a strategy; the collectives they issue pair
up only if every rank decides alike. The decisions are made from all-reduced device state (the
statistics, :mod:`strategies.gather`; a rule's declared ``reduce=`` state) — and from the host's
update count, which says which steps run ``norm_ratio``'s and ``hybrid``'s fp32 probe (a forward,
a backward and collectives that the other steps do not issue). Ranks that disagree on it (one
resumed from a stale checkpoint) would pair collectives of different sizes and hang, or train on
with different scales; torch's scalers diverge silently there.

:func:`check_ranks_agree` runs once under a process group at the first statistics pass after
construction, ``attach`` or ``load_state_dict`` (:meth:`strategies.base.Strategy._gather`): one
fixed-size all-reduce of a fingerprint — the update count, a CRC-32 of the saved state (the
``state_dict``, scales included), whether a reference closure is set, the number of layer groups —
read on the host once. A mismatch raises the same one-line ``RuntimeError`` on every rank, so
none is left waiting in a collective. After it, every rank counts the same updates.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
import torch.distributed as dist

from strategies.state import to_state_dict

__all__ = ["StateMismatch", "check_ranks_agree", "fingerprint"]


class StateMismatch(RuntimeError):
    """The ranks hold different scaler states (one line, the same on every rank)."""


def fingerprint(strategy: Any) -> list[float]:
    """``[updates, crc32 of the saved state, reference closure set, layer groups]`` (exact in
    float64). Reads the state on the host."""
    saved = to_state_dict(strategy) if strategy.params.enabled else {}
    crc = zlib.crc32(json.dumps(saved, sort_keys=True, default=repr).encode())
    closure = getattr(strategy, "_closure", None) is not None
    return [float(strategy.updates), float(crc), float(closure), float(strategy.num_groups)]


def check_ranks_agree(strategy: Any) -> bool:
    """Raise :class:`StateMismatch` on every rank unless all ranks of the default process group
    hold the same :func:`fingerprint` (one collective, one host read); True when they do."""
    mine = torch.tensor(fingerprint(strategy), dtype=torch.float64, device=strategy.state.scale.device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    values = both.tolist()
    hi, lo = values[:len(values) // 2], [-v for v in values[len(values) // 2:]]
    if hi == lo:
        return True
    (updates_hi, crc_hi, closure_hi, groups_hi), (updates_lo, crc_lo, closure_lo, groups_lo) = hi, lo
    what = []
    if updates_hi != updates_lo:
        what.append(f"update counts {int(updates_lo)}..{int(updates_hi)}")
    if crc_hi != crc_lo:
        what.append("different state_dicts")
    if closure_hi != closure_lo:
        what.append("a reference closure on some ranks only")
    if groups_hi != groups_lo:
        what.append(f"{int(groups_lo)}..{int(groups_hi)} layer groups")
    raise StateMismatch(
        f"{strategy.name}: the {dist.get_world_size()} ranks hold different scaler states ({', '.join(what)}): "
        "a rank resumed from another checkpoint or was set up differently; load the same state_dict (and call "
        "set_reference/attach alike) on every rank")
