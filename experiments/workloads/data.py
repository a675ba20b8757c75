"""Workload data that needs no download: the standard library's sources, and seeded synthetic sets.

* ``CharData`` — byte-level language modelling on the ``.py`` files at the top level of the
  running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``): a fixed, sorted
  file list, concatenated (``\\n`` between files) up to ``max_bytes``, the first
  ``1 - val_fraction`` for training and the rest for validation. The vocabulary is the 256 byte
  values, so tokenisation is deterministic and needs no fitting.
* ``TeacherVectors`` — Gaussian inputs ``x ~ N(0, I_d)`` labelled by a fixed random two-layer
  ``tanh`` teacher network (``y = argmax W2 tanh(W1 x)``), generated from ``data_seed``.
* ``TemplateImages`` — ``C x S x S`` images: one smooth random template per class, shifted by up
  to ``max_shift`` pixels, times a random gain, plus Gaussian noise; generated from ``data_seed``.

``nan_prob`` (vectors and images; 0 = off): each training batch, with this probability (drawn
from the step's generator after the batch), has its first input entry set to NaN — the "NaN
batch" failure of a broken data pipeline, which every loss scaler misreads as an overflow and
answers by backing off (the DeepSpeed/fairseq "Minimum loss scale reached" reports with a
corrupt sample behind them). Set it on the command line: ``+data.nan_prob=0.05``.

The dataset itself never depends on the run's ``seed`` (every seed trains on the same data).
Batches are drawn by :func:`step_generator`: the generator for step ``t`` is seeded from
``(seed, t)`` alone, so the data position of a resumed run is just its step and no iterator
state needs saving.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from strategies import validation as v

__all__ = ["CharData", "TeacherVectors", "TemplateImages", "step_generator", "stdlib_files"]

Batch = tuple[torch.Tensor, torch.Tensor]
EVAL_SEED = 1234


MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
    generators"): a bijection of 64-bit integers whose every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_generator(seed: int, step: int) -> torch.Generator:
    """CPU generator for the batch of ``step``: seeded with the low 32 bits of ``mix64(seed * 2**32 +
    step)``. torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so the seed must
    put ``seed`` there too: ``seed * 2**32 + step`` itself (before issue 30) gave every seed the
    same batches."""
    return torch.Generator().manual_seed(_mix64((seed * 2**32 + step) & MASK64) & 0xFFFF_FFFF)


def _check(name: str, value: object, check: v.Check) -> None:
    """``check`` (:mod:`strategies.validation`) of the option ``data.<name>``: a one-line ``ValueError`` naming it."""
    check(f"data.{name}", value)


def stdlib_files(root: str | None = None) -> list[Path]:
    """The sorted ``*.py`` files directly inside the standard library directory (no sub-packages)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files found in the standard library directory {base}")
    return files


class CharData:
    """Byte-level text from the standard library's sources (see the module docstring)."""

    kind = "text"

    def __init__(
        self,
        block_size: int = 64,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.1,
        eval_batch_size: int = 64,
        root: str | None = None,
    ) -> None:
        _check("block_size", block_size, v.whole(1))
        _check("max_bytes", max_bytes, v.whole(1000))
        _check("val_fraction", val_fraction, v.between(0.01, 0.5, "[]"))
        _check("eval_batch_size", eval_batch_size, v.whole(1))
        chunks: list[bytes] = []
        total = 0
        for path in stdlib_files(root):
            chunk = path.read_bytes() + b"\n"
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                break
        raw = b"".join(chunks)[:max_bytes]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        n_val = int(len(data) * val_fraction)
        if n_val <= block_size + 1:
            raise ValueError(
                f"data.max_bytes={max_bytes} leaves {n_val} validation bytes, fewer than block_size + 2"
            )
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.block_size = block_size
        self.vocab_size = 256
        self.eval_batch_size = eval_batch_size

    def _windows(self, split: torch.Tensor, ix: torch.Tensor) -> Batch:
        offs = torch.arange(self.block_size)
        x = split[ix[:, None] + offs]
        y = split[ix[:, None] + offs + 1]
        return x, y

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` random training windows: inputs ``[B, T]`` and next-byte targets ``[B, T]``."""
        ix = torch.randint(len(self.train) - self.block_size - 1, (batch_size,), generator=generator)
        return self._windows(self.train, ix)

    def eval_batches(self, max_batches: int) -> Iterator[Batch]:
        """The same ``max_batches`` validation batches every time (fixed generator)."""
        gen = torch.Generator().manual_seed(EVAL_SEED)
        for _ in range(max_batches):
            ix = torch.randint(len(self.val) - self.block_size - 1, (self.eval_batch_size,), generator=gen)
            yield self._windows(self.val, ix)


def _check_split(num_classes: int, n_train: int, n_val: int, eval_batch_size: int, nan_prob: float) -> None:
    """The options every classification set takes: ``data.num_classes >= 2``; ``data.n_train``,
    ``data.n_val`` and ``data.eval_batch_size >= 1``; ``data.nan_prob`` in [0, 1]."""
    _check("num_classes", num_classes, v.whole(2))
    _check("n_train", n_train, v.whole(1))
    _check("n_val", n_val, v.whole(1))
    _check("eval_batch_size", eval_batch_size, v.whole(1))
    _check("nan_prob", nan_prob, v.between(0.0, 1.0, "[]"))


class _Classification:
    """Shared batching for in-memory classification sets (``self.x_*``, ``self.y_*``)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    eval_batch_size: int
    nan_prob: float = 0.0

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` training examples drawn uniformly with replacement (NaN-poisoned with
        probability ``nan_prob``, see the module docstring)."""
        ix = torch.randint(len(self.x_train), (batch_size,), generator=generator)
        x = self.x_train[ix]
        if self.nan_prob > 0 and float(torch.rand((), generator=generator)) < self.nan_prob:
            x.view(-1)[0] = float("nan")  # x is a fresh copy (advanced indexing)
        return x, self.y_train[ix]

    def eval_batches(self, max_batches: int) -> Iterator[Batch]:
        """The validation set in order, in at most ``max_batches`` batches."""
        for i in range(max_batches):
            lo = i * self.eval_batch_size
            if lo >= len(self.x_val):
                return
            yield self.x_val[lo : lo + self.eval_batch_size], self.y_val[lo : lo + self.eval_batch_size]


class TeacherVectors(_Classification):
    """Gaussian vectors labelled by a fixed random teacher network (see the module docstring)."""

    kind = "vectors"

    def __init__(
        self,
        in_features: int = 32,
        num_classes: int = 10,
        n_train: int = 8192,
        n_val: int = 2048,
        teacher_width: int = 64,
        data_seed: int = 0,
        eval_batch_size: int = 512,
        nan_prob: float = 0.0,
    ) -> None:
        _check("in_features", in_features, v.whole(1))
        _check("teacher_width", teacher_width, v.whole(1))
        _check_split(num_classes, n_train, n_val, eval_batch_size, nan_prob)
        self.nan_prob = float(nan_prob)
        gen = torch.Generator().manual_seed(data_seed)
        w1 = torch.randn(in_features, teacher_width, generator=gen) / in_features**0.5
        w2 = torch.randn(teacher_width, num_classes, generator=gen) / teacher_width**0.5
        x = torch.randn(n_train + n_val, in_features, generator=gen)
        y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
        self.x_train, self.x_val = x[:n_train], x[n_train:]
        self.y_train, self.y_val = y[:n_train], y[n_train:]
        self.in_features = in_features
        self.num_classes = num_classes
        self.eval_batch_size = eval_batch_size


class TemplateImages(_Classification):
    """Noisy, shifted class templates as small images (see the module docstring)."""

    kind = "images"

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 16,
        num_classes: int = 10,
        n_train: int = 4096,
        n_val: int = 1024,
        noise: float = 0.5,
        max_shift: int = 2,
        data_seed: int = 0,
        eval_batch_size: int = 256,
        nan_prob: float = 0.0,
    ) -> None:
        _check("in_channels", in_channels, v.whole(1))
        _check("image_size", image_size, v.whole(4))
        _check("noise", noise, v.at_least(0.0))
        _check("max_shift", max_shift, v.whole(0))
        _check("max_shift", max_shift, v.between(0, image_size // 2, "[]"))
        _check_split(num_classes, n_train, n_val, eval_batch_size, nan_prob)
        self.nan_prob = float(nan_prob)
        gen = torch.Generator().manual_seed(data_seed)
        n = n_train + n_val
        # Smooth templates: white noise blurred by a 5x5 Gaussian (sigma 1.5), unit RMS.
        k = torch.exp(-((torch.arange(5) - 2.0) ** 2) / (2 * 1.5**2))
        kernel = (k[:, None] * k[None, :] / k.sum() ** 2).expand(in_channels, 1, 5, 5)
        raw = torch.randn(num_classes, in_channels, image_size, image_size, generator=gen)
        templates = F.conv2d(raw, kernel, padding=2, groups=in_channels)
        templates = templates / templates.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt()
        y = torch.randint(num_classes, (n,), generator=gen)
        shifts = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=gen)
        gains = 0.5 + torch.rand(n, generator=gen)
        x = torch.empty(n, in_channels, image_size, image_size)
        for i in range(n):
            x[i] = torch.roll(templates[y[i]], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
        x = x * gains[:, None, None, None] + noise * torch.randn(x.shape, generator=gen)
        self.x_train, self.x_val = x[:n_train], x[n_train:]
        self.y_train, self.y_val = y[:n_train], y[n_train:]
        self.in_channels = in_channels
        self.in_features = in_channels * image_size * image_size
        self.num_classes = num_classes
        self.eval_batch_size = eval_batch_size
