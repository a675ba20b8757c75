"""The ``rl`` workload's task: prompts, rollouts, the GRPO loss and the reward evaluation.

:class:`PolicyTask` is what ``data=rl_vowels`` builds (``kind = "rl"``, so the loop trains it with
:func:`experiments.app.rl_step.rl_step` instead of ``train_step``). One rollout batch
(:meth:`PolicyTask.rollout`) is ``prompts`` windows of ``prompt_len`` bytes of held-out text
(:class:`experiments.workloads.heldout.HeldoutChars`, the ``finetune`` files the policy was not
pretrained on), each completed ``group_size`` times with ``completion_len`` bytes sampled from the
policy in the run's precision (:func:`experiments.workloads.grpo.sample`); every completion gets a
reward computed by code (:data:`experiments.workloads.grpo.REWARDS`, default ``vowels``: the
fraction of vowels), then its group-normalised advantage. The policy is then updated ``passes``
times on that batch (PPO's epochs; ``passes >= 2`` so that the ratio ``pi / pi_old`` moves off 1
and the clipping acts) by :meth:`PolicyTask.loss`, the clipped surrogate plus, when ``kl_coef >
0``, ``kl_coef`` times the k3 estimate of ``KL(pi || pi_ref)`` to the initial policy. The default
``kl_coef = 0`` follows recent GRPO recipes that drop the KL term: DAPO (Yu et al. 2025, arXiv
2503.14476, §2.3), Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) and the fp16 study's own scripts
(sail-sg/Precision-RL ``oat/scripts/sanity/fp16_grpo.sh``: ``--beta 0``).

``pi_old`` is the sampler's log-probability (the behaviour policy, in the sampler's precision),
as in the fp16 study, where the rollout engine's probabilities enter the ratio: in an fp32 run
the first pass has ``rho = 1`` up to rounding, in a low-precision run it carries the
training/sampling mismatch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from experiments.workloads import grpo
from experiments.workloads.heldout import HeldoutChars
from strategies import validation as v

__all__ = ["EVAL_SEED", "PolicyTask", "Rollout"]

EVAL_SEED = 4321
"""Seed of the evaluation's prompts and samples: the same for every run, step and seed."""

Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass
class Rollout:
    """One rollout batch: ``tokens [M, P + L]`` (prompt then completion, ``M = prompts x
    group_size``), the sampler's ``logp_old [M, L]``, ``rewards`` and ``advantages`` ``[M]``, and the
    reference policy's ``ref_logp [M, L]`` when the loss has a KL term."""

    tokens: torch.Tensor
    logp_old: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None
    prompt_len: int


class PolicyTask:
    """GRPO on held-out text prompts with a reward computed by code (module docstring)."""

    kind = "rl"

    def __init__(self, reward: str = "vowels", prompts: int = 4, group_size: int = 8, prompt_len: int = 8,
                 completion_len: int = 8, passes: int = 2, clip_eps: float = 0.2, kl_coef: float = 0.0,
                 temperature: float = 1.0, eval_prompts: int = 64, every: int = 4, max_bytes: int = 400_000,
                 eval_batch_size: int = 64, root: str | None = None) -> None:
        self.reward = v.one_of("data.reward", reward, tuple(grpo.REWARDS))
        self.prompts = v.int_at_least("data.prompts", prompts, 1)
        self.group_size = v.int_at_least("data.group_size", group_size, 2)
        self.prompt_len = v.int_at_least("data.prompt_len", prompt_len, 1)
        self.completion_len = v.int_at_least("data.completion_len", completion_len, 1)
        self.passes = v.int_at_least("data.passes", passes, 1)
        self.clip_eps = v.open_interval("data.clip_eps", clip_eps, 0.0, 1.0)
        self.kl_coef = v.half_open_interval("data.kl_coef", kl_coef, 0.0, 1e6)
        self.temperature = v.finite_positive("data.temperature", temperature)
        self.eval_prompts = v.int_at_least("data.eval_prompts", eval_prompts, 1)
        self.block_size = self.prompt_len + self.completion_len
        self.text = HeldoutChars("finetune", every, self.block_size, max_bytes, 0.1, eval_batch_size, root)
        self.vocab_size = 256

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Language-modelling windows of the held-out text (the doctor's probe batch)."""
        return self.text.batch(batch_size, generator)

    def eval_batches(self, max_batches: int):  # noqa: ANN201 - CharData's iterator
        """The held-out text's validation batches: the evaluation's ``eval_loss`` is the policy's
        language-modelling loss there (how far RL moved it from text)."""
        return self.text.eval_batches(max_batches)

    def prompt_batch(self, n: int, generator: torch.Generator, split: str = "train") -> torch.Tensor:
        """``n`` prompts ``[n, prompt_len]``: windows of the held-out text's ``train`` (or ``val``) part."""
        text = self.text.train if split == "train" else self.text.val
        ix = torch.randint(len(text) - self.prompt_len, (n,), generator=generator)
        return text[ix[:, None] + torch.arange(self.prompt_len)]

    def rollout(self, policy: nn.Module, generator: torch.Generator, autocast: Autocast,
                reference: nn.Module | None = None, device: torch.device | str = "cpu") -> Rollout:
        """One rollout batch (module docstring), prompts and samples drawn from ``generator``."""
        prompts = self.prompt_batch(self.prompts, generator).repeat_interleave(self.group_size, dim=0).to(device)
        tokens, logp_old = grpo.sample(policy, prompts, self.completion_len, generator, self.temperature, autocast)
        rewards = grpo.REWARDS[self.reward](tokens[:, self.prompt_len:])
        ref_logp = None
        if self.kl_coef > 0:
            if reference is None:
                raise ValueError("data.kl_coef > 0 needs the reference policy")
            with torch.no_grad():
                ref_logits = grpo.policy_logits(reference, tokens, self.prompt_len)
                ref_logp = grpo.token_logp(ref_logits, tokens[:, self.prompt_len:], self.temperature)
        return Rollout(tokens, logp_old, rewards, grpo.group_advantages(rewards, self.group_size), ref_logp,
                       self.prompt_len)

    def loss(self, policy: nn.Module, rollout: Rollout) -> torch.Tensor:
        """The GRPO loss of ``rollout`` under ``policy`` (forward in the caller's autocast, loss in fp32)."""
        logits = grpo.policy_logits(policy, rollout.tokens, rollout.prompt_len)
        logp = grpo.token_logp(logits, rollout.tokens[:, rollout.prompt_len:], self.temperature)
        loss = grpo.clipped_surrogate(logp, rollout.logp_old, rollout.advantages, self.clip_eps)
        if self.kl_coef > 0 and rollout.ref_logp is not None:
            loss = loss + self.kl_coef * grpo.k3(logp, rollout.ref_logp).mean()
        return loss

    @torch.no_grad()
    def kl_to(self, policy: nn.Module, reference: nn.Module, rollout: Rollout) -> torch.Tensor:
        """``KL(pi || pi_ref)`` per completion token of ``rollout``, exact over the vocabulary, fp32."""
        logits = grpo.policy_logits(policy, rollout.tokens, rollout.prompt_len)
        return grpo.kl_exact(logits, grpo.policy_logits(reference, rollout.tokens, rollout.prompt_len),
                             self.temperature)

    @torch.no_grad()
    def eval_reward(self, policy: nn.Module, autocast: Autocast, device: torch.device | str = "cpu") -> float:
        """Mean reward of one sampled completion for each of ``eval_prompts`` fixed prompts of the
        validation text (prompts and samples from :data:`EVAL_SEED`), sampled in the run's precision."""
        gen = torch.Generator().manual_seed(EVAL_SEED)
        prompts = self.prompt_batch(self.eval_prompts, gen, split="val").to(device)
        tokens, _ = grpo.sample(policy, prompts, self.completion_len, gen, self.temperature, autocast)
        return float(grpo.REWARDS[self.reward](tokens[:, self.prompt_len:]).mean())
