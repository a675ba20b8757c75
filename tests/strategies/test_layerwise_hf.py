"""Per-layer scaling on real model code: HuggingFace transformers 5's GPT-2, Llama, BERT, T5 and
ViT (tiny configs, random init, ``tests/hf_models.py``) under ``layerwise`` (every per-group
rule) and ``underflow_target``, in fp32 and under CPU autocast fp16/bf16.

* ``attach(model)`` gives one group per block, named by the model's own module names;
* with the group scales forced apart, every parameter's unscaled gradient is GradScaler's at one
  scale — tied embeddings (GPT-2's and BERT's heads, T5's three owners of ``shared.weight``) and
  T5's encoder output read by every decoder block included. In fp32 and bf16 bit for bit (groups
  at 2^6 ... 2^14). In fp16 the groups sit at 2^14 ... 2^16, the only window where these tiny
  models neither overflow nor leave gradients subnormal (GradScaler's own fp16 gradients change
  with the scale below it): bit for bit where GradScaler gives the same gradients at 2^14, 2^15
  and 2^16 (GPT-2, Llama, T5), else no further from GradScaler at 2^15 than GradScaler at 2^14 or
  2^16 is (BERT, ViT: a few subnormal activation gradients even there);
* the steps after it train (no skipped step, finite scales), with no host read in ``scale``,
  the backward, ``unscale_`` and ``update``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import strategies
from strategies.model_layers import layers
from tests.helpers import forbid_host_sync

pytest.importorskip("transformers", minversion="5", reason="transformers>=5 is an optional test dependency "
                    "(pip install -e '.[models]'): the HF model tests need it")
from tests.hf_models import CASES, HFCase  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:layerwise. parameters")]
IDS = [c.name for c in CASES]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
RULES = ["max_ema", "backoff_growth", "adaloss"]


def autocast(precision: str) -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[precision]
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def gradscaler_grads(case: HFCase, model: torch.nn.Module, precision: str,
                     scale: float = 2.0**10) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with autocast(precision):
        loss = case.loss(model)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    return [p.grad.clone() for p in model.parameters()]


def set_scales(s, scales: list[float]) -> None:
    s.scale(torch.ones(()))
    sd = s.state_dict()
    sd["extra"]["scale"] = scales
    s.load_state_dict(sd)


def deviation(g: torch.Tensor, w: torch.Tensor) -> float:
    """``max|g - w| / max|w|``."""
    return float((g - w).abs().max() / w.abs().max())


def assert_exact(model: torch.nn.Module, want: list[torch.Tensor], tolerance: float = 0.0) -> None:
    got = {n: p.grad for n, p in model.named_parameters()}
    bad = {n: deviation(g, w) for (n, g), w in zip(got.items(), want) if not torch.equal(g, w)}
    assert max(bad.values(), default=0.0) <= tolerance, f"gradients off GradScaler's (relative error): {bad}"


APART = [2.0 ** (6 + 2 * k) for k in range(5)]
"""Group scales in fp32 and bf16, one after the other: 2^6 ... 2^14."""


def reference(case: HFCase, model: torch.nn.Module, precision: str) -> tuple[list[torch.Tensor], float, list[float]]:
    """GradScaler's gradients, the tolerance and the group scales for ``precision`` (module docstring)."""
    if precision != "fp16":
        return gradscaler_grads(case, model, precision), 0.0, APART
    want = gradscaler_grads(case, model, precision, 2.0**15)
    tolerance = max(deviation(g, w) for k in (14, 16) for g, w in zip(gradscaler_grads(case, model, precision, 2.0**k),
                                                                      want))
    return want, tolerance, [2.0**14, 2.0**15, 2.0**16]


def scaled_backward(s, case: HFCase, model: torch.nn.Module, precision: str) -> torch.optim.Optimizer:
    """The forward under ``precision``; scale, backward and ``unscale_`` with no host read."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with autocast(precision):
        loss = case.loss(model)
    with forbid_host_sync():
        s.scale(loss).backward()
        s.unscale_(opt)
    return opt


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_default_groups_are_the_blocks_named_as_the_model_names_them(case: HFCase) -> None:
    model = case.build()
    assert layers(model) == case.layers
    assert strategies.create("layerwise").attach(model).group_names == case.groups


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_layerwise_gives_gradscalers_gradients_with_group_scales_apart(case: HFCase, rule: str,
                                                                       precision: str) -> None:
    model = case.build()
    want, tolerance, apart = reference(case, model, precision)
    s = strategies.create("layerwise", rule=rule).attach(model)
    set_scales(s, [apart[k % len(apart)] for k in range(s.num_groups)])
    opt = scaled_backward(s, case, model, precision)
    assert_exact(model, want, tolerance)
    s.step(opt)
    for _ in range(3):  # and it trains
        with forbid_host_sync():
            s.update()
        opt.zero_grad()
        with autocast(precision):
            loss = case.loss(model)
        s.scale(loss).backward()
        s.step(opt)
    tel = s.telemetry()
    assert tel["skipped_steps"].item() == 0 and torch.isfinite(tel["scales"]).all()


PER_STACK = ["shared", "encoder.block.*", "encoder.final_layer_norm", "decoder.block.*", "decoder.final_layer_norm",
             "lm_head"]


@pytest.mark.parametrize("per", ["block", "stack"])
def test_t5_groups_named_without_its_embed_tokens_are_exact(per: str) -> None:
    """The patterns a user writes for T5 name ``shared``, not the ``encoder.embed_tokens`` and
    ``decoder.embed_tokens`` that own ``shared.weight`` too (its gradient was off by the ratio of
    the group scales); per block, the encoder's output is read by both decoder blocks."""
    case = next(c for c in CASES if c.name == "t5")
    model = case.build()
    want = gradscaler_grads(case, model, "fp32")
    groups = [n for n in case.layers if not n.endswith("embed_tokens")] if per == "block" else PER_STACK
    with pytest.warns(UserWarning, match=r"encoder\.embed_tokens owns shared\.weight"):
        s = strategies.create("layerwise", groups=groups).attach(model)
    set_scales(s, [APART[k % len(APART)] for k in range(s.num_groups)])
    scaled_backward(s, case, model, "fp32")
    assert_exact(model, want)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_underflow_target_observes_the_blocks_and_gives_gradscalers_gradients(case: HFCase, precision: str) -> None:
    model = case.build()
    want = gradscaler_grads(case, model, precision)
    s = strategies.create("underflow_target", init_scale=2.0**10).attach(model)
    opt = scaled_backward(s, case, model, precision)
    assert_exact(model, want)
    assert s.state.exp_hist.sum().item() > 0  # the blocks' activation gradients were observed
    s.step(opt)
    with forbid_host_sync():
        s.update()
    assert s.telemetry()["skipped_steps"].item() == 0 and s.get_scale() != 2.0**10
