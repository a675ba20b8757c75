"""A character GPT pretrained by scalelab, in fp32, once: the starting point of ``finetune`` and ``rl``.

Fine-tuning and RL fine-tuning start from a trained model, not from an initialisation: their
gradients are those of a model that already predicts its data well, which are small (a confident
softmax leaves ``p - 1[y]`` near zero on most classes), and they train at low learning rates. That
is where fp16 gradients underflow without any artificial loss multiplier. scalelab makes that
model itself, so nothing is downloaded:

* :class:`PretrainSpec` — the pretraining run: the GPT's shape, steps, batch, learning rate,
  seed and the text split (:mod:`experiments.workloads.heldout`: the ``pretrain`` files, disjoint
  from the ``finetune`` files the workloads train on afterwards).
* :func:`pretrain` — nanoGPT's recipe in fp32: AdamW (betas 0.9/0.99, weight decay 0.1 on
  matrices), linear warmup then cosine decay to ``lr / 10``, clip 1.0; batches drawn by
  :func:`experiments.workloads.data.step_generator` from the spec's seed, the model initialised
  from the seed in a forked RNG (the caller's RNG state is left as it was).
* :func:`pretrained_state` — the weights, made once per spec and cached under ``cache_dir`` as
  ``gpt-<digest>.pt``, ``digest`` a hash of the spec (:mod:`experiments.workloads.cache`: made
  under a file lock, written atomically, read with ``weights_only=True``; a file whose stored spec
  differs is refused with a one-line error).
* :class:`PretrainedGPT` — the model a config builds (``conf/model/gpt_pretrained.yaml``): a
  :class:`experiments.workloads.models.GPT` of the spec's shape holding the cached weights, the
  same for every seed (as every fine-tuning run of a study starts from one checkpoint), with
  ``keep_fp32`` (:mod:`experiments.workloads.keep_fp32`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from experiments.workloads.cache import cached
from experiments.workloads.data import step_generator
from experiments.workloads.heldout import HeldoutChars
from experiments.workloads.keep_fp32 import keep_in_fp32
from experiments.workloads.models import GPT
from strategies import validation as v

__all__ = ["FORMAT", "PretrainSpec", "PretrainedGPT", "cache_file", "pretrain", "pretrained_state"]

FORMAT = 2
"""Version of the pretraining recipe: part of every digest, so a change of :func:`pretrain` makes new
files (2: batches drawn by the fixed :func:`experiments.workloads.data.step_generator`)."""


@dataclass(frozen=True)
class PretrainSpec:
    """One pretraining run (module docstring); every field is part of the cache digest."""

    n_layer: int = 1
    n_head: int = 4
    n_embd: int = 32
    block_size: int = 16
    steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    seed: int = 0
    every: int = 4
    max_bytes: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "steps", "batch_size"):
            v.int_at_least(f"model.pretrain.{name}", getattr(self, name), 1)
        v.int_at_least("model.pretrain.warmup", self.warmup, 0)
        v.int_at_least("model.pretrain.seed", self.seed, 0)
        v.int_at_least("model.pretrain.every", self.every, 2)
        v.int_at_least("model.pretrain.max_bytes", self.max_bytes, 1000)
        v.greater_than("model.pretrain.lr", self.lr, 0.0)

    def digest(self) -> str:
        """16 hex digits of the SHA-256 of the spec and :data:`FORMAT` (sorted-key JSON)."""
        text = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lr(step: int, spec: PretrainSpec) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``lr / 10`` at the last step."""
    if step <= spec.warmup:
        return spec.lr * step / (spec.warmup + 1)
    ratio = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * ratio)))


def pretrain(spec: PretrainSpec) -> dict[str, Any]:
    """Train the spec's GPT in fp32 (module docstring); returns ``{"model": state_dict, "spec":
    the spec as a dict, "val_loss": held-out loss on the pretraining split's validation text}``."""
    data = HeldoutChars("pretrain", spec.every, spec.block_size, spec.max_bytes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = GPT(256, spec.block_size, spec.n_layer, spec.n_head, spec.n_embd)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.99))
    for step in range(1, spec.steps + 1):
        x, y = data.batch(spec.batch_size, step_generator(spec.seed, step))
        for group in opt.param_groups:
            group["lr"] = _lr(step, spec)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        val = [F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)) for x, y in data.eval_batches(8)]
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    return {"model": state, "spec": asdict(spec), "val_loss": torch.stack(val).mean()}


def cache_file(spec: PretrainSpec, cache_dir: str | Path) -> Path:
    """Where ``spec``'s weights are cached: ``<cache_dir>/gpt-<digest>.pt``."""
    return Path(cache_dir) / f"gpt-{spec.digest()}.pt"


def pretrained_state(spec: PretrainSpec, cache_dir: str | Path) -> dict[str, torch.Tensor]:
    """The spec's pretrained weights: from the cache, or pretrained now and cached (module docstring)."""
    path = cache_file(spec, cache_dir)

    def make() -> dict[str, Any]:
        print(f"scalelab: pretraining the {spec.n_layer}x{spec.n_embd} character GPT in fp32 for {spec.steps} steps, "
              f"once (cached as {path})", file=sys.stderr)
        return pretrain(spec)

    def check(obj: dict[str, Any]) -> str | None:
        if obj.get("spec") != asdict(spec):
            return f"its pretraining spec {obj.get('spec')} is not {asdict(spec)}"
        return None if isinstance(obj.get("model"), dict) else "it holds no model state"

    obj, _ = cached(path, make, check)
    return obj["model"]


class PretrainedGPT(GPT):
    """The pretrained character GPT (module docstring): ``PretrainSpec`` fields prefixed
    ``pretrain_``, the cache folder, and the modules kept in fp32 under autocast."""

    accepts = ("text", "rl")

    def __init__(self, vocab_size: int = 256, block_size: int = 16, n_layer: int = 1, n_head: int = 4,
                 n_embd: int = 32, pretrain_steps: int = 3000, pretrain_batch_size: int = 32,
                 pretrain_lr: float = 3e-3, pretrain_warmup: int = 100, pretrain_seed: int = 0,
                 pretrain_every: int = 4, pretrain_max_bytes: int = 1_000_000,
                 cache_dir: str = "runs/pretrained", keep_fp32: list[str] | tuple[str, ...] = ()) -> None:
        if vocab_size != 256:
            raise ValueError(f"model.vocab_size must be 256 (bytes) for the pretrained GPT, got {vocab_size}")
        spec = PretrainSpec(n_layer, n_head, n_embd, block_size, pretrain_steps, pretrain_batch_size, pretrain_lr,
                            pretrain_warmup, pretrain_seed, pretrain_every, pretrain_max_bytes)
        super().__init__(256, block_size, n_layer, n_head, n_embd)
        self.load_state_dict(pretrained_state(spec, cache_dir))
        self.spec = spec
        self.keep_fp32 = keep_in_fp32(self, list(keep_fp32))
