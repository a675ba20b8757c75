"""The failure workloads: explicit attention equals the fused one, QK-norm, the FFN gain, NaN batches."""

from __future__ import annotations

import pytest
import torch

from experiments.workloads.data import TeacherVectors, TemplateImages
from experiments.workloads.models import GPT


def test_explicit_attention_is_sdpa_restated() -> None:
    torch.manual_seed(0)
    fused = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)
    explicit = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, attention="explicit")
    explicit.load_state_dict(fused.state_dict())
    idx = torch.randint(32, (3, 16))
    torch.testing.assert_close(explicit(idx), fused(idx), rtol=1e-5, atol=1e-5)


def test_qk_norm_normalises_each_heads_queries_and_keys() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, qk_norm=True)
    block = model.blocks[0]
    assert block.q_norm.normalized_shape == (16,) and block.k_norm.normalized_shape == (16,)
    seen = []
    block.q_norm.register_forward_hook(lambda m, a, out: seen.append(out))
    model(torch.randint(32, (2, 16)))
    q = seen[0]
    torch.testing.assert_close(q.mean(-1), torch.zeros_like(q.mean(-1)), atol=1e-5, rtol=0)


def test_ffn_gain_scales_both_ffn_matrices_only() -> None:
    torch.manual_seed(0)
    base = GPT(vocab_size=32, block_size=16, n_layer=1, n_embd=32)
    torch.manual_seed(0)
    big = GPT(vocab_size=32, block_size=16, n_layer=1, n_embd=32, ffn_gain=10.0)
    for (name, a), (_, b) in zip(base.named_parameters(), big.named_parameters()):
        factor = 10.0 if name.endswith(("fc.weight", "fc_out.weight")) else 1.0
        torch.testing.assert_close(b, a * factor, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"attention": "flash"}, "model.attention must be one of sdpa, explicit, got 'flash'"),
    ({"qk_norm": 1}, "model.qk_norm must be true or false, got 1"),
    ({"ffn_gain": 0.0}, "model.ffn_gain must be >= 1e-12, got 0.0"),
])
def test_bad_model_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        GPT(vocab_size=32, block_size=16, n_layer=1, n_embd=32, **kwargs)


@pytest.mark.parametrize("cls", [TeacherVectors, TemplateImages])
def test_nan_batches_come_at_the_rate_asked_and_only_then(cls: type) -> None:
    kw = {"n_train": 256, "n_val": 64}
    clean, poisoned = cls(**kw), cls(nan_prob=0.25, **kw)
    hits = 0
    for step in range(200):
        xc, yc = clean.batch(8, torch.Generator().manual_seed(step))
        xp, yp = poisoned.batch(8, torch.Generator().manual_seed(step))
        assert torch.isfinite(xc).all() and torch.equal(yc, yp)  # the same examples are drawn
        bad = ~torch.isfinite(xp)
        hits += int(bad.any())
        assert int(bad.sum()) <= 1 and torch.equal(xp[~bad], xc[~bad])
    assert 30 <= hits <= 70  # 200 draws at p = 0.25: mean 50, sd 6.1
    assert torch.isfinite(poisoned.x_train).all()  # the stored data is never touched
    with pytest.raises(ValueError, match="nan_prob must be in"):
        cls(nan_prob=1.5, **kw)
