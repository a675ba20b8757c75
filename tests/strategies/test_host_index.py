"""``host_tensor``: the cache of small constant tensors, and the ones a CUDA graph capture used,
which it never evicts (a graph reads them through raw pointers, holding no reference)."""

from __future__ import annotations

import pytest
import torch

from strategies import host_index
from strategies.host_index import KEEP, host_tensor

CPU = torch.device("cpu")


def _flood(n: int) -> None:
    for k in range(n):
        host_tensor((10**6 + k,), torch.int64, CPU)


def test_cached_and_equal_to_torch_tensor() -> None:
    t = host_tensor((3, 1, 2), torch.int64, CPU)
    assert host_tensor((3, 1, 2), torch.int64, CPU) is t
    assert torch.equal(t, torch.tensor([3, 1, 2])) and t.dtype == torch.int64


def test_a_key_is_evicted_after_keep_others_unless_a_capture_used_it(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = host_tensor((7, 8, 9), torch.int64, CPU)
    monkeypatch.setattr(host_index, "capturing", lambda device: True)  # stands in for a CUDA capture
    kept = host_tensor((4, 5, 6), torch.int64, CPU)
    before = host_index.pinned()
    monkeypatch.setattr(host_index, "capturing", lambda device: False)
    _flood(KEEP + 8)
    assert host_tensor((4, 5, 6), torch.int64, CPU) is kept  # the graph's tensor is still the one it reads
    assert host_tensor((7, 8, 9), torch.int64, CPU) is not plain  # an ordinary key was evicted and made again
    assert host_index.pinned() == before


def test_a_hit_during_a_capture_pins_the_cached_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made before the capture (a warm-up step), read during it: that tensor is the one pinned."""
    warm = host_tensor((11, 12), torch.int64, CPU)
    monkeypatch.setattr(host_index, "capturing", lambda device: True)
    assert host_tensor((11, 12), torch.int64, CPU) is warm
    monkeypatch.setattr(host_index, "capturing", lambda device: False)
    _flood(KEEP + 8)
    assert host_tensor((11, 12), torch.int64, CPU) is warm


def test_the_capture_check_asks_cuda_only_for_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(True) or False)
    assert not host_index.capturing(CPU) and asked == []
    assert not host_index.capturing(torch.device("cuda", 0)) and asked == [True]
