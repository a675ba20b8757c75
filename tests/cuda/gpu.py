"""GPU helpers of the kernel tests: no host sync allowed, same-layout copies to the GPU, the
statistics pass's chunk geometry, and the kernel-against-reference check of the statistics."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from strategies import kernel_build
from strategies.stats import GradStats, unscale_and_stats_reference
from tests.cuda.gradients import assert_bits_equal


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")

def _geometry() -> tuple[int, int, int, int]:
    """(smallest and largest elements per chunk, chunks per launch, blocks wanted per SM) of the
    statistics pass, read from its source so the re-launch cases follow the kernel (the larger
    table: CUDA 12.1+)."""
    src = (kernel_build.source_dir() / "kernels" / "stats_kernel.cu").read_text()
    chunk = 1 << int(re.search(r"constexpr int64_t kChunk = 1 << (\d+);", src).group(1))
    max_chunk = 1 << int(re.search(r"constexpr int64_t kMaxChunk = 1 << (\d+);", src).group(1))
    per_launch = max(int(m) for m in re.findall(r"constexpr int kMaxChunks = (\d+);", src))
    per_sm = int(re.search(r"constexpr int kBlocksPerSm = (\d+);", src).group(1))
    return chunk, max_chunk, per_launch, per_sm

CHUNK, MAX_CHUNK, CHUNKS_PER_LAUNCH, BLOCKS_PER_SM = _geometry()


def chunk_for(total: int, sms: int) -> int:
    """The kernel's chunk_for(), restated: the largest of MAX_CHUNK, MAX_CHUNK / 2, ..., CHUNK that
    leaves ``total // chunk`` at least BLOCKS_PER_SM blocks per SM."""
    chunk = MAX_CHUNK
    while chunk > CHUNK and total // chunk < BLOCKS_PER_SM * sms:
        chunk //= 2
    return chunk

def to_cuda(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Same values, sizes, strides and storage offset (so the same alignment relative to 16 bytes)
    on the GPU: the whole storage is copied and viewed the same way."""
    out = []
    for g in gs:
        storage = torch.empty(0, dtype=g.dtype).set_(g.untyped_storage())
        out.append(storage.to("cuda").as_strided(g.size(), g.stride(), g.storage_offset()))
    return out

def check_stats(ops, a: list[torch.Tensor], b: list[torch.Tensor], inv: torch.Tensor, groups: list[int] | None,
                num_groups: int) -> GradStats:
    """The kernel on ``a`` against the reference on ``b`` (same values, same layouts): every
    gradient bit, found_inf, abs-max and the counts exact; sums of squares to 1e-6 of float64."""
    with no_sync():
        got = GradStats(*ops.unscale_and_stats(a, inv, [] if groups is None else groups, num_groups))
    want = unscale_and_stats_reference(b, inv, groups, num_groups)
    for x, y in zip(a, b):
        assert x.stride() == y.stride()
        assert_bits_equal(x.cpu(), y.cpu())
    assert torch.equal(got.found_inf, want.found_inf)
    torch.testing.assert_close(got.absmax, want.absmax, rtol=0, atol=0, equal_nan=True)
    for f in ("zeros", "subnormals", "numel"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    truth = torch.zeros(num_groups, dtype=torch.float64, device="cuda")
    for k, g in enumerate(b):
        truth[0 if groups is None else groups[k]] += g.double().square().sum()
    torch.testing.assert_close(got.sumsq.double(), truth.float().double(), rtol=1e-6, atol=0, equal_nan=True)
    return got
