"""The doctor on HuggingFace models, which pass every input by keyword (``model(inputs_embeds=...)``,
``self_attn(hidden_states=..., position_embeddings=..., cache=...)``): its forward hooks see the
keyword arguments, so a NaN that comes in with ``inputs_embeds`` is not blamed on the model
that received it, and the fp32 re-run of an overflowing attention module is called with its
keyword arguments (its key-value cache left out), so the value it reports is the module's fp32
output, not ``inf``. GPT-2 and Llama from tiny configs (``tests/hf_models.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.doctor import diagnose

pytest.importorskip("transformers", minversion="5", reason="transformers>=5 is an optional test dependency "
                    "(pip install -e '.[models]'): the HF model tests need it")
from tests.hf_models import IDS, gpt2, llama  # noqa: E402

MODELS = {
    "gpt2": (gpt2, lambda m: m.transformer.wte, "transformer.wte", "transformer.h.0.attn",
             lambda m: [m.transformer.h[0].attn.c_attn.weight[:, :64]]),
    "llama": (llama, lambda m: m.model.embed_tokens, "model.embed_tokens", "model.layers.0.self_attn",
              lambda m: [m.model.layers[0].self_attn.q_proj.weight, m.model.layers[0].self_attn.k_proj.weight]),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def lm(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return m(input_ids=batch, labels=batch).loss


@pytest.mark.parametrize("name", list(MODELS))
def test_a_nan_in_inputs_embeds_is_blamed_on_the_input_not_the_model(name: str) -> None:
    model = build(name)
    embeds = MODELS[name][1](model)(IDS).detach().clone()
    embeds[1, 3, 5] = float("nan")
    d = diagnose(model, lambda m, b: m(inputs_embeds=b[0], labels=b[1]).loss, (embeds, IDS), compare_strategies=False)
    assert d.cause == "nan_in_data_or_loss" and d.first_module is None, (d.first_module, d.tensor)
    assert d.evidence[0].startswith("batch tensor 0 ((2, 8, 32)) holds 1 NaN/Inf")


@pytest.mark.parametrize("name", list(MODELS))
def test_a_nan_in_the_embedding_is_blamed_on_the_embedding(name: str) -> None:
    model = build(name)
    with torch.no_grad():
        MODELS[name][1](model).weight[int(IDS[0, 2])] = float("nan")
    d = diagnose(model, lm, IDS, compare_strategies=False)
    assert d.cause == "nan_in_data_or_loss" and d.first_module == MODELS[name][2]


@pytest.mark.parametrize("name", list(MODELS))
def test_an_overflow_inside_attention_gets_the_fp32_value_of_the_module(name: str) -> None:
    """q and k x3000: the fp16 attention scores overflow, q and k themselves do not; the module's
    fp32 outputs (its attention output and probabilities) are finite and at most 1 in size."""
    model = build(name)
    with torch.no_grad():
        for w in MODELS[name][4](model):
            w.mul_(3000.0)
    d = diagnose(model, lm, IDS, compare_strategies=False)
    assert d.cause == "forward_overflow" and d.first_module == MODELS[name][3]
    assert d.value is not None and math.isfinite(d.value) and 0.0 < d.value <= 1.0 + 1e-6, d.value
    assert "an intermediate inside it" in d.evidence[1]
