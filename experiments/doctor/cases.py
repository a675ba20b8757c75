"""The doctor's labelled fault suite: small models with one known fault planted in each.

Each :class:`Case` builds a model, a loss and a batch, and labels them with the cause
(``strategies.doctor.CAUSES``) and, where construction defines one, the first module that leaves
the format's range. The faults and where they come from:

* ``forward_overflow`` — a GPT whose FFN weights start ``ffn_gain`` times larger, so that
  ``blocks.0.fc_out`` outputs more than 65504 (T5's ``wo``, HF transformers #9295); a GPT whose
  attention logits have grown (``attention="explicit"``, q/k weights scaled: Wortsman et al.
  2023), first module ``blocks.0.scores``; an MLP whose hidden layer ``k`` outputs too much.
* ``nan_in_data_or_loss`` — a NaN entry in the batch (a broken data pipeline), or a loss that is
  non-finite in fp32 (``log(0)``).
* ``grads_not_cleared`` — the step runs on a model (MLP or GPT) whose ``.grad`` holds ``k``
  earlier steps' gradients (the missing ``optimizer.zero_grad()`` loop bug), or an earlier
  step's fp16 overflow (a scaled backward at 2^16 of a loss 1e5x too large: the skipped step's
  inf stays in ``.grad`` — what ``train.zero_grad=false`` does in a real run).
* ``lr_spike`` — twenty SGD steps at the schedule's rate, one at 300x it, then the doctor, given
  that learning-rate history.
* ``gradient_overflow`` — a sum-reduced loss (``reduction="sum"``, MLP or GPT) whose gradient
  exceeds fp16's range at S = 1: first module ``head``.
* ``scale_overflow`` — a loss 100x larger than the default scale allows: overflow at 2^16 only.
* ``underflow`` — the fp16 policy-gradient toy: REINFORCE's ``-A log pi(a|s)`` with advantages
  ``|A| ~ 1e-7`` (the small-gradient case of Micikevicius et al. 2018, as in fp16 RL
  fine-tuning), and a GPT under the ``tiny_grad`` regime's loss multiplier 1e-8.
* ``block_clipping`` — the same MLP and GPT cast as MXFP4 (E2M1 values, OCP FLOOR scale rounding)
  in every role: a block max with mantissa from 1.75 up saturates from 7 to 6 (ROCm/aiter PR 3212;
  arXiv 2506.08027); the control, RCEIL rounding, clips nothing and is ``healthy``.
* ``healthy`` — the same models with nothing planted, and the FFN-overflow GPT in bf16 (the
  control: bf16's range holds the T5-style output, so the doctor must not cry wolf).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from experiments.workloads.models import GPT, MLP
from strategies.block_recipes import MX

__all__ = ["SEEDS", "Case", "cases"]

SEEDS = (0, 1, 2)


@dataclass
class Case:
    """One labelled fault: ``build()`` returns ``(model, loss_fn, batch, diagnose keywords)``."""

    name: str
    cause: str
    module: str | None
    build: Callable[[], tuple[torch.nn.Module, Callable, Any, dict]]


def _ce(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _mlp(seed: int, width: int, depth: int = 3, n: int = 64) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = MLP(in_features=32, num_classes=10, width=width, depth=depth)
    g = torch.Generator().manual_seed(1000 + seed)
    return model, (torch.randn(n, 32, generator=g), torch.randint(10, (n,), generator=g))


def _gpt(seed: int, n_embd: int, **kw: Any) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=n_embd, **kw)
    g = torch.Generator().manual_seed(1000 + seed)
    return model, (torch.randint(64, (4, 32), generator=g), torch.randint(64, (4, 32), generator=g))


def _with_ce(model_batch: tuple[torch.nn.Module, Any]) -> tuple[torch.nn.Module, Callable, Any, dict]:
    return model_batch[0], _ce, model_batch[1], {}


def _scaled(loss_fn: Callable, factor: float) -> Callable:
    return lambda model, batch: loss_fn(model, batch) * factor


def _forward_cases(seed: int) -> list[Case]:
    def logits(n: int) -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, n, attention="explicit")
            with torch.no_grad():
                for block in model.blocks:
                    block.qkv.weight[: 2 * n].mul_(2000.0 / math.sqrt(n / 32))  # q and k rows only
            return _with_ce((model, batch))
        return build

    def hidden(width: int, k: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            with torch.no_grad():
                model.layers[k][0].weight.mul_(1e6)
            return _with_ce((model, batch))
        return build

    out = [Case(f"ffn_overflow/gpt{n}/s{seed}", "forward_overflow", "blocks.0.fc_out",
                lambda n=n: _with_ce(_gpt(seed, n, ffn_gain=1500.0))) for n in (32, 64)]
    out += [Case(f"logit_growth/gpt{n}/s{seed}", "forward_overflow", "blocks.0.scores", logits(n)) for n in (32, 64)]
    out += [Case(f"hidden_overflow/mlp{w}/l{k}/s{seed}", "forward_overflow", f"layers.{k}.0", hidden(w, k))
            for w, k in ((32, 1), (64, 2))]
    return out


def _nan_cases(seed: int) -> list[Case]:
    def data(width: int) -> Callable:
        def build() -> tuple:
            model, (x, y) = _mlp(seed, width)
            x = x.clone()
            x[seed % len(x), (7 * seed) % x.shape[1]] = float("nan")
            return model, _ce, (x, y), {}
        return build

    def log_zero(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            return model, (lambda m, b: _ce(m, b) + torch.log(torch.zeros(()))), batch, {}
        return build

    return ([Case(f"nan_batch/mlp{w}/s{seed}", "nan_in_data_or_loss", None, data(w)) for w in (32, 64)]
            + [Case(f"log_zero_loss/mlp{w}/s{seed}", "nan_in_data_or_loss", None, log_zero(w)) for w in (32, 64)])


def _accumulated_cases(seed: int) -> list[Case]:
    def build_for(width: int, k: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            for _ in range(k):  # the loop bug: backward every step, zero_grad never
                _ce(model, batch).backward()
            return model, _ce, batch, {}
        return build

    def gpt(k: int) -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, 32)
            for _ in range(k):
                _ce(model, batch).backward()
            return model, _ce, batch, {}
        return build

    def kept_overflow(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            with torch.autocast("cpu", dtype=torch.float16):  # an earlier step that overflowed (skipped)
                (_ce(model, batch) * 1e5 * 2.0**16).backward()
            return model, _ce, batch, {}
        return build

    return ([Case(f"grads_not_cleared/mlp{w}/k{k}/s{seed}", "grads_not_cleared", None, build_for(w, k))
             for w, k in ((32, 4), (64, 10))]
            + [Case(f"grads_not_cleared/gpt32/k4/s{seed}", "grads_not_cleared", None, gpt(4))]
            + [Case(f"overflow_kept_in_grad/mlp{w}/s{seed}", "grads_not_cleared", None, kept_overflow(w))
               for w in (32, 64)])


def _lr_spike_cases(seed: int) -> list[Case]:
    def build_for(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            history = [1e-3] * 20
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for lr in history + [1e-3 * 3e5]:  # the spike: a schedule bug multiplies the peak
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.zero_grad()
                _ce(model, batch).backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return model, _ce, batch, {"lr_history": history + [1e-3 * 3e5]}
        return build

    return [Case(f"lr_spike/mlp{w}/s{seed}", "lr_spike", None, build_for(w)) for w in (32, 64)]


def _gradient_cases(seed: int) -> list[Case]:
    def summed(width: int, n: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width, n=n)
            loss = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1], reduction="sum") * 1e5
            return model, loss, batch, {}
        return build

    def summed_gpt() -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, 32)
            loss = lambda m, b: F.cross_entropy(m(b[0]).float().reshape(-1, 64), b[1].reshape(-1), reduction="sum") * 1e5
            return model, loss, batch, {}
        return build

    def large(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            return model, _scaled(_ce, 100.0), batch, {}
        return build

    return ([Case(f"sum_loss/mlp{w}/n{n}/s{seed}", "gradient_overflow", "head", summed(w, n)) for w, n in ((32, 64), (64, 256))]
            + [Case(f"sum_loss/gpt32/s{seed}", "gradient_overflow", "head", summed_gpt())]
            + [Case(f"large_loss/mlp{w}/s{seed}", "scale_overflow", "head", large(w)) for w in (32, 64)])


def _underflow_cases(seed: int) -> list[Case]:
    def reinforce(width: int, adv: float) -> Callable:
        def build() -> tuple:
            model, (x, _) = _mlp(seed, width)
            g = torch.Generator().manual_seed(2000 + seed)
            with torch.no_grad():
                actions = torch.multinomial(model(x).softmax(-1), 1, generator=g).squeeze(1)
            advantages = adv * torch.randn(len(x), generator=g)

            def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
                logp = m(b[0]).float().log_softmax(-1).gather(1, b[1][:, None]).squeeze(1)
                return -(b[2] * logp).mean()
            return model, loss, (x, actions, advantages), {}
        return build

    def tiny_gpt() -> tuple:
        model, batch = _gpt(seed, 32)
        return model, _scaled(_ce, 1e-8), batch, {}  # the tiny_grad regime's loss multiplier

    return ([Case(f"pg_small_advantage/mlp{w}/A{a:g}/s{seed}", "underflow", None, reinforce(w, a))
             for w, a in ((32, 1e-7), (64, 3e-8))]
            + [Case(f"tiny_grad/gpt32/s{seed}", "underflow", None, tiny_gpt)])


def _healthy_cases(seed: int) -> list[Case]:
    return ([Case(f"plain/mlp{w}/s{seed}", "healthy", None, lambda w=w: _with_ce(_mlp(seed, w))) for w in (32, 64)]
            + [Case(f"plain/gpt32/s{seed}", "healthy", None, lambda: _with_ce(_gpt(seed, 32))),
               Case(f"bf16_control/ffn_overflow/gpt32/s{seed}", "healthy", None, lambda: (
                   *_with_ce(_gpt(seed, 32, ffn_gain=1500.0))[:3], {"precision": "bf16"}))])


def _block_cases(seed: int) -> list[Case]:
    def mxfp4(made: tuple, rounding: str) -> tuple:
        recipe = MX(elem="e2m1", scale_rounding=rounding)
        return (*made[:3], {"precision": "bf16", "blocks": dict.fromkeys(("activation", "weight", "gradient"), recipe)})

    return ([Case(f"mxfp4_floor/mlp32/s{seed}", "block_clipping", None, lambda: mxfp4(_with_ce(_mlp(seed, 32)), "floor")),
             Case(f"mxfp4_floor/gpt32/s{seed}", "block_clipping", None, lambda: mxfp4(_with_ce(_gpt(seed, 32)), "floor")),
             Case(f"mxfp4_rceil_control/mlp32/s{seed}", "healthy", None, lambda: mxfp4(_with_ce(_mlp(seed, 32)), "rceil"))])


def cases(seeds: tuple[int, ...] = SEEDS) -> list[Case]:
    """Every labelled case, for every seed."""
    out: list[Case] = []
    for seed in seeds:
        for make in (_forward_cases, _nan_cases, _accumulated_cases, _lr_spike_cases, _gradient_cases,
                     _underflow_cases, _healthy_cases, _block_cases):
            out += make(seed)
    return out
