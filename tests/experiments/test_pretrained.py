"""The pretrained character GPT and its cache (experiments/workloads/{heldout,cache,pretrained,keep_fp32}.py):
disjoint text splits, cache miss then hit, one maker when two processes start together, a corrupt
or foreign file refused with a one-line error, the model holding the cached weights, keep_fp32."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.workloads import cache as cache_mod
from experiments.workloads import pretrained as pt
from experiments.workloads.data import stdlib_files
from experiments.workloads.heldout import HeldoutChars, split_files
from experiments.workloads.keep_fp32 import keep_in_fp32

ROOT = Path(__file__).resolve().parents[2]
TINY = pt.PretrainSpec(n_layer=1, n_head=2, n_embd=8, block_size=8, steps=3, batch_size=4, warmup=1, max_bytes=20000)


def test_the_splits_are_disjoint_and_cover_every_file() -> None:
    files = stdlib_files()
    fine, pre = split_files(files, "finetune", 4), split_files(files, "pretrain", 4)
    assert fine and pre and not set(fine) & set(pre) and sorted(fine + pre) == files
    assert fine == files[::4]


def test_heldout_text_comes_from_its_own_files() -> None:
    fine = HeldoutChars("finetune", 4, block_size=8, max_bytes=5000)
    first = split_files(stdlib_files(), "finetune", 4)[0].read_bytes()
    assert bytes(fine.train[:100].tolist()) == first[:100]
    x, y = fine.batch(3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="data.split must be one of"):
        HeldoutChars("test")


def test_digest_follows_every_field() -> None:
    assert TINY.digest() == pt.PretrainSpec(**{**TINY.__dict__}).digest()
    assert len({TINY.digest(), pt.PretrainSpec(**{**TINY.__dict__, "seed": 1}).digest(),
                pt.PretrainSpec(**{**TINY.__dict__, "lr": 1e-3}).digest()}) == 3
    with pytest.raises(ValueError, match="model.pretrain.steps must be an integer >= 1"):
        pt.PretrainSpec(steps=0)


def test_cache_miss_then_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = pt.pretrain
    monkeypatch.setattr(pt, "pretrain", lambda spec: calls.append(spec) or real(spec))
    first = pt.pretrained_state(TINY, tmp_path)
    assert len(calls) == 1 and pt.cache_file(TINY, tmp_path).exists()
    second = pt.pretrained_state(TINY, tmp_path)
    assert len(calls) == 1  # a hit: nothing trained again
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_corrupt_file_is_refused_with_one_line(tmp_path: Path) -> None:
    path = pt.cache_file(TINY, tmp_path)
    path.write_bytes(b"not a torch file\n" * 10)
    with pytest.raises(cache_mod.CacheError) as e:
        pt.pretrained_state(TINY, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "delete it" in msg


def test_a_file_of_another_spec_is_refused(tmp_path: Path) -> None:
    other = pt.PretrainSpec(**{**TINY.__dict__, "seed": 5})
    cache_mod.atomic_save(pt.cache_file(TINY, tmp_path), pt.pretrain(other))
    with pytest.raises(cache_mod.CacheError, match="does not match what this run needs"):
        pt.pretrained_state(TINY, tmp_path)


_MAKER = """
import hashlib, json, sys, time
from pathlib import Path
from experiments.workloads import pretrained as pt
spec = pt.PretrainSpec(**json.loads(sys.argv[1]))
folder, me = Path(sys.argv[2]), sys.argv[3]
(folder / f"ready-{me}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
state = pt.pretrained_state(spec, folder / "cache")
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest())
"""


def test_two_processes_starting_together_pretrain_once(tmp_path: Path) -> None:
    spec = pt.PretrainSpec(**{**TINY.__dict__, "steps": 300})  # long enough (~1 s) for the second to wait
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SCALELAB_KERNELS": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", _MAKER, json.dumps(spec.__dict__), str(tmp_path), str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert sum(o[1].count("scalelab: pretraining") for o in outs) == 1
    assert outs[0][0] == outs[1][0]  # both read the same weights


def test_the_model_holds_the_cached_weights(tmp_path: Path) -> None:
    kw = dict(block_size=8, n_layer=1, n_head=2, n_embd=8, pretrain_steps=3, pretrain_batch_size=4, pretrain_warmup=1,
              pretrain_max_bytes=20000, cache_dir=str(tmp_path))
    torch.manual_seed(0)
    a = pt.PretrainedGPT(**kw)
    torch.manual_seed(1)  # the run's seed does not change the starting weights
    b = pt.PretrainedGPT(**kw)
    state = pt.pretrained_state(TINY, tmp_path)
    assert all(torch.equal(a.state_dict()[k], state[k]) and torch.equal(b.state_dict()[k], state[k]) for k in state)
    assert "rl" in pt.PretrainedGPT.accepts and "text" in pt.PretrainedGPT.accepts


def test_keep_in_fp32_runs_the_module_in_fp32_under_autocast() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    seen: dict[str, torch.dtype] = {}
    for name in ("0", "1"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    assert keep_in_fp32(model, ["1"]) == ["1"]
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert seen == {"0": torch.float16, "1": torch.float32} and out.dtype == torch.float32
    out.sum().backward()
    assert model[1].weight.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="model.keep_fp32 names a module the model does not have: 'head'"):
        keep_in_fp32(model, ["head"])


def test_a_deep_copy_keeps_its_own_fp32_module() -> None:
    """The frozen reference policy is a deep copy: its kept module must run its own weights."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    keep_in_fp32(model, ["1"])
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref[1].weight.zero_()
        ref[1].bias.zero_()
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(ref(x), torch.zeros(3, 2)) and not torch.equal(model(x), torch.zeros(3, 2))
