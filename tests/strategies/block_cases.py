"""Input tensors of the block-quantiser tests: random, adversarial and real gradients, and a
bit-level comparison that treats any two NaNs as equal."""

from __future__ import annotations

import torch

F32_TINY = torch.finfo(torch.float32).tiny
F32_MAX = torch.finfo(torch.float32).max


def random_matrix(rows: int = 40, cols: int = 200, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with log-normal row scales (dynamic range across blocks); ``cols`` is no
    multiple of 32 or 128, so the last blocks are padded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)


def adversarial(rows: int = 34, cols: int = 160, seed: int = 1) -> dict[str, torch.Tensor]:
    """One tensor per hazard, each with ordinary rows around the hazardous ones."""
    g = torch.Generator().manual_seed(seed)

    def base() -> torch.Tensor:
        return torch.randn(rows, cols, generator=g)

    zero_blocks = base()
    zero_blocks[::3] = 0.0
    zero_blocks[:, 16:48] = 0.0
    huge = base()
    huge[2, 5], huge[7, 100], huge[20, 33] = 3.0e38, -F32_MAX, 65504.0 * 1024
    subnormal = base()
    subnormal[:8] = torch.randn(8, cols, generator=g) * 1e-40
    subnormal[8, :] = 1e-45
    subnormal[9, :] = F32_TINY
    subnormal[10] = torch.randn(cols, generator=g) * 2.0**-120
    exact = base()
    exact[:4] = 448.0 * 2.0 ** torch.randint(-30, 30, (4, cols), generator=g).float()
    exact[4:8] = 6.0 * 2.0 ** torch.randint(-30, 30, (4, cols), generator=g).float()
    nan = base()
    nan[3, 17] = float("nan")
    inf = base()
    inf[5, 7], inf[11, 150] = float("inf"), -float("inf")
    return {"zero_blocks": zero_blocks, "all_zero": torch.zeros(rows, cols), "huge": huge,
            "subnormal": subnormal, "exact_maxima": exact, "nan": nan, "inf": inf}


def mlp_gradients(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weight and activation gradients of a small GELU MLP with a LayerNorm, one backward pass."""
    torch.manual_seed(seed)
    net = torch.nn.ModuleDict({"fc1": torch.nn.Linear(32, 96), "ln": torch.nn.LayerNorm(96),
                               "fc2": torch.nn.Linear(96, 48)})
    x = torch.randn(40, 32)
    h = net["fc1"](x)
    h.retain_grad()
    a = torch.nn.functional.gelu(net["ln"](h))
    a.retain_grad()
    loss = torch.nn.functional.cross_entropy(net["fc2"](a), torch.randint(0, 48, (40,)))
    loss.backward()
    return {"fc1.weight.grad": net["fc1"].weight.grad, "fc2.weight.grad": net["fc2"].weight.grad,
            "h.grad": h.grad, "a.grad": a.grad}


def all_inputs() -> dict[str, torch.Tensor]:
    """Every named input: random, adversarial and gradients."""
    return {"random": random_matrix(), **adversarial(), **mlp_gradients()}


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bit patterns, or both NaN (NaN payloads are not compared)."""
    a, e = actual.float().contiguous(), expected.float().contiguous()
    return (a.view(torch.int32) == e.view(torch.int32)) | (a.isnan() & e.isnan())


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    ok = same_bits(actual, expected)
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} differ; first at {i}: "
                             f"{actual.float()[i].item()!r} != {expected.float()[i].item()!r}")
