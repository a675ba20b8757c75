"""GRPO's pieces, each a plain function: sampler, group advantages, clipped surrogate, KL estimators.

The ``rl`` workload fine-tunes a pretrained character GPT with the policy gradient of GRPO
(DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, §4.1) — PPO's clipped surrogate (Schulman et
al. 2017, arXiv 1707.06347) with the value function replaced by group-normalised rewards — in the
setting where fp16 came back: "Defeating the Training-Inference Mismatch via FP16" (Qi et al.
2025, arXiv 2510.26788) samples the rollouts and trains the policy in fp16, with a loss scaler.

* :func:`sample` — ``L`` tokens per prompt from the policy ``pi(. | prefix) = softmax(z / T)``, the
  forward under the caller's autocast (the sampler's precision: fp16 for an fp16 run, so the
  behaviour policy is the fp16 policy, as in arXiv 2510.26788), the log-probabilities in fp32.
  Exact sampling by the Gumbel-max trick, ``argmax_v z_v / T + g_v`` with ``g = -log(-log u)``,
  ``u`` uniform from a CPU generator: the same tokens for a seed on any device.
* :func:`group_advantages` — ``A_i = (r_i - mean_g r) / (std_g r + eps)`` over the ``G`` samples
  of one prompt (DeepSeekMath eq. 3; the unbiased std, as verl's ``compute_grpo_outcome_advantage``
  and TRL's ``GRPOTrainer`` compute it); a group whose rewards are all equal has ``A = 0``.
* :func:`clipped_surrogate` — ``-mean_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)``,
  ``rho_t = exp(log pi(o_t) - log pi_old(o_t))`` (PPO eq. 7, GRPO eq. 3; eps = 0.2), the mean over
  every completion token of the batch (all completions have the same length).
* :func:`k3` — the KL estimator ``exp(d) - d - 1``, ``d = log pi_ref - log pi`` (Schulman 2020,
  "Approximating KL divergence"; GRPO eq. 4), unbiased for ``KL(pi || pi_ref)`` under samples of
  ``pi`` and never negative; :func:`kl_exact`, the per-token KL over the whole vocabulary, for records.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["REWARDS", "clipped_surrogate", "group_advantages", "k3", "kl_exact", "policy_logits",
           "sample", "token_logp", "vowel_fraction"]

VOWELS = torch.tensor(sorted(b"aeiouAEIOU"))


def vowel_fraction(completions: torch.Tensor) -> torch.Tensor:
    """``r = #{t : o_t in "aeiouAEIOU"} / L`` per completion ``[M, L] -> [M]`` (fp32): a reward a
    small character model learns within a few hundred updates (it must shift probability from
    code's usual bytes to vowels) and that code checks exactly."""
    return torch.isin(completions, VOWELS.to(completions.device)).float().mean(dim=1)


REWARDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"vowels": vowel_fraction}
"""Reward name (``data.reward``) -> ``completions [M, L] -> rewards [M]``."""


def policy_logits(model: nn.Module, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits that predict each completion token: ``model(tokens[:, :-1])`` at positions
    ``prompt_len - 1 .. T - 2``, ``[M, L, V]`` (the dtype the forward produced)."""
    return model(tokens[:, :-1])[:, prompt_len - 1:]


def token_logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(z / T)`` of each taken token, in fp32: ``[M, L, V], [M, L] -> [M, L]``."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample(model: nn.Module, prompts: torch.Tensor, length: int, generator: torch.Generator,
           temperature: float = 1.0, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [M, P + L], logp [M, L])``: ``length`` tokens appended to each prompt ``[M, P]``,
    each drawn from ``softmax(z / T)`` of the forward on the sequence so far (run inside
    ``autocast()``), and its fp32 log-probability (module docstring)."""
    tokens = prompts
    taken = []
    for _ in range(length):
        with autocast():
            z = model(tokens)[:, -1]
        logp = F.log_softmax(z.float() / temperature, dim=-1)
        u = torch.rand(logp.shape, generator=generator).clamp_(min=1e-20).to(logp.device)
        nxt = (logp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)
        taken.append(logp.gather(-1, nxt))
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens, torch.cat(taken, dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``A = (r - mean_g) / (std_g + eps)`` within each run of ``group_size`` consecutive rewards
    (one prompt's samples), the unbiased std; ``[M] -> [M]``; all-equal groups give 0."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the {rewards.numel()} rewards, got {group_size}")
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).view(-1)


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_eps: float = 0.2) -> torch.Tensor:
    """PPO/GRPO's clipped surrogate loss (module docstring): ``logp``, ``logp_old`` ``[M, L]``,
    ``advantages`` ``[M]`` (one per completion, shared by its tokens) -> a scalar."""
    ratio = torch.exp(logp - logp_old)
    a = advantages[:, None]
    return -torch.minimum(ratio * a, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * a).mean()


def k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's ``k3 = exp(d) - d - 1``, ``d = logp_ref - logp``, per token (module docstring)."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


def kl_exact(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``mean_t sum_v pi(v) (log pi(v) - log pi_ref(v))`` over every position of ``[..., V]``, in fp32."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    logq = F.log_softmax(ref_logits.float() / temperature, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()
