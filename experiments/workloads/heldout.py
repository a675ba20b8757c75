"""Disjoint splits of the standard library's sources: text to pretrain on and held-out text to fine-tune on.

The ``finetune`` and ``rl`` workloads start from a character GPT that scalelab pretrained itself
(:mod:`experiments.workloads.pretrained`) and then train it further on text it has never seen, as
real fine-tuning does. Both read the ``.py`` files at the top level of the standard library
(:func:`experiments.workloads.data.stdlib_files`, a fixed sorted list) and split them by file:

* ``finetune``: the files whose index ``i`` in the sorted list has ``i % every == 0``;
* ``pretrain``: every other file.

No file is in both, so no byte of the fine-tuning text (its training and its validation part) was
seen in pretraining. Within a split the files are concatenated (``\\n`` between them) up to
``max_bytes``, and the last ``val_fraction`` is the validation text, as in
:class:`experiments.workloads.data.CharData`, whose batching :class:`HeldoutChars` inherits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.workloads.data import CharData, stdlib_files
from strategies import validation as v

__all__ = ["SPLITS", "HeldoutChars", "split_files", "split_bytes"]

SPLITS = ("pretrain", "finetune")


def split_files(files: list[Path], split: str, every: int) -> list[Path]:
    """The files of ``split``: index ``i % every == 0`` is ``finetune``, the rest ``pretrain``."""
    v.one_of("data.split", split, SPLITS)
    v.int_at_least("data.every", every, 2)
    held_out = [i % every == 0 for i in range(len(files))]
    return [f for f, out in zip(files, held_out) if out == (split == "finetune")]


def split_bytes(split: str, every: int, max_bytes: int, root: str | None = None) -> bytes:
    """The first ``max_bytes`` of ``split``'s files concatenated, ``\\n`` after each file."""
    chunks: list[bytes] = []
    total = 0
    for path in split_files(stdlib_files(root), split, every):
        chunks.append(path.read_bytes() + b"\n")
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class HeldoutChars(CharData):
    """Byte-level text of one split of the standard library's files (module docstring); batches,
    validation batches and the 256-byte vocabulary are :class:`CharData`'s."""

    kind = "text"

    def __init__(self, split: str = "finetune", every: int = 4, block_size: int = 16, max_bytes: int = 400_000,
                 val_fraction: float = 0.1, eval_batch_size: int = 64, root: str | None = None) -> None:
        v.int_at_least("data.block_size", block_size, 1)
        v.int_at_least("data.max_bytes", max_bytes, 1000)
        v.between(0.01, 0.5, "[]")("data.val_fraction", val_fraction)
        v.int_at_least("data.eval_batch_size", eval_batch_size, 1)
        raw = split_bytes(split, every, max_bytes, root)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        n_val = int(len(data) * val_fraction)
        if n_val <= block_size + 1 or len(data) - n_val <= block_size + 1:
            raise ValueError(f"data.max_bytes={max_bytes} leaves too little {split} text for data.block_size={block_size}")
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.block_size, self.vocab_size, self.eval_batch_size = block_size, 256, eval_batch_size
        self.split, self.every = split, every
