"""GRPO's pieces (experiments/workloads/grpo.py) against plain-Python restatements of their formulas:
the sampler (shapes, determinism for a seed, its precision, exact sampling), the reward, the group
advantages (normalisation, zero-variance groups), PPO's clipped surrogate and the KL estimators."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from experiments.workloads import grpo


class Bigram(nn.Module):
    """A next-token model whose logits depend on the last token only: ``z = W[x_t]``."""

    def __init__(self, vocab: int = 256, seed: int = 0) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)
        self.lin = nn.Linear(vocab, vocab)
        torch.manual_seed(seed)
        nn.init.normal_(self.table.weight, 0.0, 2.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.table(idx))


def fp16() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.float16)


def test_sampler_shapes_and_log_probs() -> None:
    model, prompts = Bigram(), torch.randint(256, (6, 3), generator=torch.Generator().manual_seed(1))
    tokens, logp = grpo.sample(model, prompts, 5, torch.Generator().manual_seed(2))
    assert tokens.shape == (6, 8) and logp.shape == (6, 5) and logp.dtype == torch.float32
    assert torch.equal(tokens[:, :3], prompts)
    with torch.no_grad():  # logp is the policy's log-probability of each sampled token
        again = grpo.token_logp(grpo.policy_logits(model, tokens, 3), tokens[:, 3:])
    torch.testing.assert_close(logp, again)


def test_sampler_is_deterministic_for_a_seed() -> None:
    model, prompts = Bigram(), torch.zeros(4, 2, dtype=torch.long)
    a = grpo.sample(model, prompts, 6, torch.Generator().manual_seed(7))
    b = grpo.sample(model, prompts, 6, torch.Generator().manual_seed(7))
    c = grpo.sample(model, prompts, 6, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_sampler_runs_the_forward_in_the_given_precision() -> None:
    model, seen = Bigram(), []
    model.lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    grpo.sample(model, torch.zeros(2, 1, dtype=torch.long), 3, torch.Generator().manual_seed(0), autocast=fp16)
    grpo.sample(model, torch.zeros(2, 1, dtype=torch.long), 1, torch.Generator().manual_seed(0))
    assert seen == [torch.float16] * 3 + [torch.float32]


def test_gumbel_max_samples_the_softmax() -> None:
    """Empirical frequencies of one position match softmax(z / T) (Gumbel-max is exact sampling)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])

    class Fixed(nn.Module):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return logits.expand(idx.shape[0], idx.shape[1], 4)

    n, temperature = 20000, 2.0
    tokens, _ = grpo.sample(Fixed(), torch.zeros(n, 1, dtype=torch.long), 1, torch.Generator().manual_seed(0),
                            temperature=temperature)
    freq = torch.bincount(tokens[:, 1], minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits / temperature, 0), atol=0.015, rtol=0)


def test_vowel_reward() -> None:
    done = torch.tensor([list(b"aeiou"), list(b"xyzAb"), list(b"     ")])
    torch.testing.assert_close(grpo.vowel_fraction(done), torch.tensor([1.0, 0.2, 0.0]))
    assert set(grpo.REWARDS) == {"vowels"}


def plain_advantages(rewards: list[float], g: int, eps: float = 1e-6) -> list[float]:
    """DeepSeekMath eq. 3 with the unbiased std, one group at a time."""
    out = []
    for i in range(0, len(rewards), g):
        group = rewards[i:i + g]
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def test_group_advantages_normalise_each_group() -> None:
    r = [0.1, 0.5, 0.3, 0.9, 0.0, 0.0, 1.0, 0.25]
    a = grpo.group_advantages(torch.tensor(r), 4)
    torch.testing.assert_close(a, torch.tensor(plain_advantages(r, 4)))
    for group in a.view(2, 4):
        assert abs(float(group.mean())) < 1e-6 and abs(float(group.std()) - 1.0) < 1e-4


def test_a_zero_variance_group_has_zero_advantage() -> None:
    a = grpo.group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 0.0]), 3)
    assert a[:3].tolist() == [0.0, 0.0, 0.0] and torch.isfinite(a).all()


def test_group_size_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo.group_advantages(torch.zeros(4), 1)


def plain_surrogate(logp: list[list[float]], old: list[list[float]], adv: list[float], eps: float) -> float:
    """PPO's clipped objective (Schulman et al. 2017, eq. 7), negated, mean over every token."""
    terms = []
    for row, row_old, a in zip(logp, old, adv):
        for lp, lo in zip(row, row_old):
            ratio = math.exp(lp - lo)
            terms.append(min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a))
    return -sum(terms) / len(terms)


def test_clipped_surrogate_is_ppos_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(5, 4, generator=gen) * 3, -torch.rand(5, 4, generator=gen) * 3  # ratios far from 1
    adv = torch.randn(5, generator=gen)
    got = grpo.clipped_surrogate(logp, old, adv, 0.2)
    want = plain_surrogate(logp.tolist(), old.tolist(), adv.tolist(), 0.2)
    assert abs(float(got) - want) < 1e-5


def test_clipping_stops_the_gradient_outside_the_trust_region() -> None:
    """A positive advantage with rho > 1 + eps (and a negative one with rho < 1 - eps) gives no gradient."""
    logp = torch.tensor([[0.5, -0.5, 0.05]], requires_grad=True)
    old = torch.zeros(1, 3)
    grpo.clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2).backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    logp.grad = None
    grpo.clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2).backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0


def test_k3_is_schulmans_estimator() -> None:
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    want = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(grpo.k3(logp, ref), torch.tensor(want))
    assert (grpo.k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_k3_is_unbiased_for_the_kl() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    samples = torch.multinomial(p, 200000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = grpo.k3(p.log()[samples], q.log()[samples]).mean()
    exact = float((p * (p / q).log()).sum())
    assert abs(float(estimate) - exact) < 0.01
    torch.testing.assert_close(grpo.kl_exact(p.log()[None], q.log()[None]), torch.tensor(exact))
