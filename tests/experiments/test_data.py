"""Workload data: deterministic, fixed splits, no dependence on the run seed."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from experiments.workloads.data import CharData, TeacherVectors, TemplateImages, stdlib_files, step_generator


def test_stdlib_files_are_a_fixed_sorted_top_level_list() -> None:
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and all(p.parent == root and p.suffix == ".py" for p in files)
    assert root / "os.py" in files


def test_char_data_is_the_stdlib_bytes_with_a_fixed_tail_split() -> None:
    data = CharData(block_size=8, max_bytes=20_000, val_fraction=0.1)
    raw = b"".join(p.read_bytes() + b"\n" for p in stdlib_files())[:20_000]
    expected = torch.tensor(list(raw))
    assert torch.equal(torch.cat([data.train, data.val]), expected)
    assert len(data.val) == 2000 and data.vocab_size == 256
    x, y = data.batch(5, step_generator(0, 3))
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next byte
    x2, _ = data.batch(5, step_generator(0, 3))
    x3, _ = data.batch(5, step_generator(0, 4))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    ev1 = [b[0] for b in data.eval_batches(2)]
    ev2 = [b[0] for b in data.eval_batches(2)]
    assert all(torch.equal(a, b) for a, b in zip(ev1, ev2))


def test_each_seed_draws_its_own_batches() -> None:
    """Seeds fix the data order: (seed, step) -> its own batch. torch's CPU generator keeps only the
    low 32 bits of a seed, which seed * 2**32 + step left to the step alone (every seed the same data)."""
    data = CharData(block_size=8, max_bytes=20_000)
    batches = {(seed, step): data.batch(4, step_generator(seed, step))[0] for seed in range(3) for step in range(1, 4)}
    assert len({tuple(b.flatten().tolist()) for b in batches.values()}) == len(batches)
    assert torch.equal(batches[(1, 2)], data.batch(4, step_generator(1, 2))[0])


@pytest.mark.parametrize("cls,kw", [(TeacherVectors, {"n_train": 300, "n_val": 100}),
                                    (TemplateImages, {"n_train": 300, "n_val": 100, "image_size": 8, "max_shift": 1})])
def test_synthetic_sets_depend_on_data_seed_only(cls, kw) -> None:
    a, b, c = cls(**kw), cls(**kw), cls(data_seed=1, **kw)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert not torch.equal(a.x_train, c.x_train)
    assert len(a.x_train) == 300 and len(a.x_val) == 100
    assert len(set(a.y_train.tolist())) >= a.num_classes // 2  # labels are not degenerate
    sizes = [len(x) for x, _ in a.eval_batches(100)]
    assert sum(sizes) == 100


def test_bad_data_options_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"data.val_fraction must be in \[0.01, 0.5\], got 0.9"):
        CharData(val_fraction=0.9)
    with pytest.raises(ValueError, match=r"data.max_shift must be in \[0, 4\], got 5"):
        TemplateImages(image_size=8, max_shift=5)
