"""On a GPU: a graph that indexes with ``host_tensor`` tensors keeps reading the right indices
after the cache has moved on by more than it keeps (``strategies.host_index``)."""

from __future__ import annotations

import gc

import pytest
import torch

from strategies.host_index import KEEP, host_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_captured_index_survives_the_cache_moving_on() -> None:
    dev = torch.device("cuda", 0)
    src = torch.arange(1.0, 5.0, device=dev)
    out = torch.zeros(4, device=dev)
    idx = (3, 2, 1, 0)
    host_tensor(idx, torch.int64, dev)  # made in a warm-up step, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.zero_()
        out.index_add_(0, host_tensor(idx, torch.int64, dev), src)
    for k in range(KEEP + 8):  # would evict the index tensor
        host_tensor((k, k + 1), torch.int64, dev)
    gc.collect()
    junk = [torch.full((4,), 2**40, dtype=torch.int64, device=dev) for _ in range(4096)]  # would take its memory
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.tensor([4.0, 3.0, 2.0, 1.0], device=dev))
    assert all(bool((j == 2**40).all()) for j in junk[:64])
