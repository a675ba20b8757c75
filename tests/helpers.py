"""Shared test helpers."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")


class HostSyncError(AssertionError):
    """A tensor was read on the host where the contract forbids it."""


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Make every Python-level host read of a tensor raise :class:`HostSyncError`.

    On the CPU nothing truly synchronises, so this is how the suite shows that ``scale``,
    ``unscale_`` and ``update`` would not synchronise on a GPU: they never ask for a value.
    """
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def make(name: str):
        def raiser(self, *args, **kwargs):
            raise HostSyncError(f"host sync: Tensor.{name}() called")

        return raiser

    try:
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, make(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def mlp(seed: int = 0, width: int = 16, depth: int = 3, d_in: int = 8, d_out: int = 4) -> torch.nn.Sequential:
    """A small deterministic MLP."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    d = d_in
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(d, width), torch.nn.Tanh()]
        d = width
    layers.append(torch.nn.Linear(d, d_out))
    return torch.nn.Sequential(*layers)


def batch(step: int, n: int = 16, d_in: int = 8, d_out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def optimizer_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        if sa[k].keys() != sb[k].keys():
            return False
        for name in sa[k]:
            x, y = sa[k][name], sb[k][name]
            if isinstance(x, torch.Tensor):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
