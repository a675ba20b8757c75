"""Tiny HuggingFace transformers 5 models for the tests that run scalelab on real model code:
GPT-2, BERT, T5, Llama and ViT from small configs (two blocks, hidden 32, vocabulary 100), random
init (never ``from_pretrained``, no network), dropout off. Each :class:`HFCase` carries its batch
and loss, its layers (:func:`strategies.model_layers.layers`) and its default ``layerwise`` groups
(tied weights merged) as a user reading the model's module names would expect them.

transformers is an optional test dependency (the ``models`` extra): import this module only after
``pytest.importorskip("transformers", minversion="5")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import transformers as tf

tf.logging.set_verbosity_error()  # tiny configs: token ids and loss types HF would warn about

V, T = 100, 8
IDS = torch.randint(1, V, (2, T), generator=torch.Generator().manual_seed(11))
LABELS = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(12))
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(13))


@dataclass(frozen=True)
class HFCase:
    name: str
    build: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module], torch.Tensor]
    layers: list[str]
    groups: list[str]


def _seeded(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return make()
    return build


def gpt2() -> torch.nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0, attn_implementation="eager"))


def llama() -> torch.nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=16, attn_implementation="eager"))


def bert() -> torch.nn.Module:
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=16,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5() -> torch.nn.Module:
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                     pad_token_id=0))


def vit() -> torch.nn.Module:
    return tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0))


def _lm(m: torch.nn.Module) -> torch.Tensor:
    return m(input_ids=IDS, labels=IDS).loss


CASES = [
    HFCase("gpt2", _seeded(gpt2), _lm,
           ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"],
           ["transformer.wte+lm_head", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"]),
    HFCase("llama", _seeded(llama), _lm,
           ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
           ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]),
    HFCase("bert", _seeded(bert), _lm,
           ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
           ["bert.embeddings+cls", "bert.encoder.layer.0", "bert.encoder.layer.1"]),
    HFCase("t5", _seeded(t5), lambda m: m(input_ids=IDS, labels=LABELS).loss,
           ["shared", "encoder.embed_tokens", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
            "decoder.embed_tokens", "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"],
           ["shared+encoder.embed_tokens+decoder.embed_tokens+lm_head", "encoder.block.0", "encoder.block.1",
            "encoder.final_layer_norm", "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm"]),
    HFCase("vit", _seeded(vit), lambda m: F.cross_entropy(m(pixel_values=PIXELS).logits, torch.tensor([0, 3])),
           ["vit.embeddings", "vit.layers.0", "vit.layers.1", "vit.layernorm", "classifier"],
           ["vit.embeddings", "vit.layers.0", "vit.layers.1", "vit.layernorm", "classifier"]),
]
"""The five models, each with its loss, layers and default groups."""
