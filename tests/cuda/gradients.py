"""Random gradient lists with the values that matter to the statistics pass."""

from __future__ import annotations

import torch

from strategies.formats import FP16_MIN_NORMAL

SPECIALS = {
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "zero": 0.0,
    "-zero": -0.0,
    "fp16_min_normal": FP16_MIN_NORMAL,  # not subnormal
    "below_min_normal": FP16_MIN_NORMAL * (1 - 2.0**-11),  # just below: subnormal (fp16 rounds it to 2^-14 -> not)
    "fp16_min_sub": 2.0**-24,
    "fp32_sub": 1e-40,
    "big": 6e4,
    "huge": 3e38,
}


def make_grad(
    n: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    specials: tuple[str, ...] = (),
    layout: str = "contiguous",
) -> torch.Tensor:
    """``n`` log-uniform magnitudes over [2^-30, 2^8] with random signs, a few specials
    sprinkled in, stored as ``dtype``. ``layout``:

    * ``contiguous``;
    * ``column_major``: ``(n/3, 3)`` transposed (dense, not contiguous) when 3 divides n, else contiguous;
    * ``strided``: every other element of a buffer (not dense);
    * ``offset``: contiguous, starting one element into a buffer (not 16-byte aligned);
    * ``transposed``: ``torch.empty(3, n).t()`` (3n elements, column-major for every n);
    * ``transposed_slice``: ``torch.empty(3, n + 1)[:, 1:].t()`` (3n elements, neither dense nor
      aligned).
    """
    m = 3 * n if layout in ("transposed", "transposed_slice") else n
    x = _values(m, gen, specials).to(dtype)
    if layout == "transposed":
        return x.reshape(3, n).t()
    if layout == "transposed_slice":
        buf = torch.zeros(3, n + 1, dtype=dtype)
        buf[:, 1:] = x.reshape(3, n)
        return buf[:, 1:].t()
    if layout == "offset":
        buf = torch.zeros(n + 1, dtype=dtype)
        buf[1:] = x
        return buf[1:]
    return _arrange(x, n, dtype, layout)


def _values(n: int, gen: torch.Generator, specials: tuple[str, ...]) -> torch.Tensor:
    mag = torch.exp2(torch.empty(n).uniform_(-30, 8, generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x = mag * sign
    if n:
        zeros = torch.rand(n, generator=gen) < 0.05
        x[zeros] = 0.0
        for name in specials:
            idx = torch.randint(0, n, (max(1, n // 500),), generator=gen)
            x[idx] = SPECIALS[name]
    return x


def _arrange(x: torch.Tensor, n: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        return x
    if layout == "column_major" and n % 3 == 0 and n:
        return x.reshape(n // 3, 3).t().contiguous().t()  # dense but not contiguous
    if layout == "strided":
        base = torch.zeros(2 * n, dtype=dtype)
        base[::2] = x
        return base[::2]
    return x


def make_grads(
    sizes: list[int],
    dtype: torch.dtype,
    seed: int,
    specials: tuple[str, ...] = (),
    layouts: tuple[str, ...] = ("contiguous",),
) -> list[torch.Tensor]:
    """A gradient list; the same arguments give an identical, independent list (same layouts)."""
    gen = torch.Generator().manual_seed(seed)
    return [make_grad(n, dtype, gen, specials, layouts[k % len(layouts)]) for k, n in enumerate(sizes)]


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical values; NaNs must sit at the same positions (payloads may differ)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), "NaN positions differ"
    ia, ib = (t.contiguous().view(_SAME_WIDTH_INT[t.element_size()]) for t in (a, b))
    keep = ~na.contiguous()
    diff = (ia != ib) & keep
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {int(diff.nonzero()[0])}"


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (c10's ``is_non_overlapping_and_dense``, which Python lacks): the
    elements fill one block of ``numel`` slots in some order, so a kernel may run over the storage."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
