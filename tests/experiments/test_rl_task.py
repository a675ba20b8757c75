"""The rl workload's task (experiments/workloads/rl_task.py): rollout batches, the GRPO loss over
passes, the KL term and the reward evaluation, on a small random GPT."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from experiments.workloads.models import GPT
from experiments.workloads.rl_task import PolicyTask


def task(**kw) -> PolicyTask:
    return PolicyTask(**{"prompts": 3, "group_size": 4, "prompt_len": 4, "completion_len": 5, "eval_prompts": 8,
                         "max_bytes": 20000, **kw})


def policy(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(256, 9, n_layer=1, n_head=2, n_embd=16)


def test_rollout_shapes_rewards_and_advantages() -> None:
    t, model = task(), policy()
    ro = t.rollout(model, torch.Generator().manual_seed(0), contextlib.nullcontext)
    assert ro.tokens.shape == (12, 9) and ro.logp_old.shape == (12, 5) and ro.prompt_len == 4
    assert torch.equal(ro.tokens[0, :4], ro.tokens[3, :4]) and not torch.equal(ro.tokens[0, :4], ro.tokens[4, :4])
    assert ((ro.rewards >= 0) & (ro.rewards <= 1)).all() and ro.ref_logp is None
    for group in ro.advantages.view(3, 4):
        assert abs(float(group.sum())) < 1e-4


def test_first_pass_of_an_fp32_rollout_has_ratio_one() -> None:
    """With pi_old from the fp32 sampler, pass 1 has rho = 1: the loss is -mean(A) = 0 and its
    gradient the policy gradient; after an update, pass 2 has rho != 1."""
    t, model = task(), policy()
    ro = t.rollout(model, torch.Generator().manual_seed(1), contextlib.nullcontext)
    loss = t.loss(model, ro)
    assert abs(float(loss.detach())) < 1e-6
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().max()) > 0 for g in grads)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    with torch.no_grad():
        assert abs(float(t.loss(model, ro))) > 1e-6


def test_kl_term_needs_the_reference_and_is_zero_at_it() -> None:
    t, model = task(kl_coef=0.1), policy()
    with pytest.raises(ValueError, match="needs the reference policy"):
        t.rollout(model, torch.Generator().manual_seed(0), contextlib.nullcontext)
    ref = copy.deepcopy(model)
    ro = t.rollout(model, torch.Generator().manual_seed(0), contextlib.nullcontext, reference=ref)
    assert ro.ref_logp is not None and ro.ref_logp.shape == (12, 5)
    assert abs(float(t.loss(model, ro))) < 1e-6  # k3 = 0 at pi = pi_ref, surrogate = 0 at rho = 1
    assert float(t.kl_to(model, ref, ro)) == pytest.approx(0.0, abs=1e-7)
    assert float(t.kl_to(model, policy(seed=3), ro)) > 0


def test_eval_reward_is_fixed_for_fixed_weights() -> None:
    t, model = task(), policy()
    a = t.eval_reward(model, contextlib.nullcontext)
    assert a == t.eval_reward(model, contextlib.nullcontext) and 0.0 <= a <= 1.0


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="data.group_size must be an integer >= 2"):
        task(group_size=1)
    with pytest.raises(ValueError, match="data.reward must be one of 'vowels'"):
        task(reward="digits")
    with pytest.raises(ValueError, match=r"data.clip_eps must be in \(0, 1\)"):
        task(clip_eps=0.0)
