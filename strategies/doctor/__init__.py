"""Why does the loss scale collapse, and what would fix it? One step, diagnosed.

``diagnose(model, loss_fn, batch, precision="fp16", scaler=None)`` re-runs one training step
of the user's own model on the user's own batch and returns a :class:`Diagnosis`. It needs no
training loop: ``loss_fn(model, batch)`` must return the scalar loss (the forward included).

Passes (the model's weights, ``.grad``, buffers and RNG state are left as they were):

1. **mixed**: forward under ``torch.autocast(dtype=fp16|bf16)`` with a forward hook on every
   module, then backward of ``loss * S`` (``S`` = the scaler's scale, else 2^16, the
   ``GradScaler`` default) with full backward hooks; when that backward overflows, a second
   backward of ``loss * 1`` through the same graph tells whether the overflow is
   *scale-independent*;
2. **fp32**: forward and backward with autocast off: the reference gradient ``r`` and the fp32
   activation-gradient abs-max of each module.

So two forward+backward passes by default; ``compare_strategies=True`` (the default) adds
backward passes only (through the retained mixed graph): one per registered strategy to see the
scale it would choose from this gradient, one per distinct such scale to measure its damage.
Strategies that hook the forward pass (``layerwise``, ``underflow_target``) need a forward of
their own: with ``forward_strategies=True`` they get one each, else they are listed as not
compared. The damage at a scale is measured with one loss scale for the whole model (for
``layerwise``, its loss-side scale: the per-layer rescaling is not replayed).

**First module out of range.** Forward: the first module, in completion order, whose inputs are
finite and whose output is not (inner modules complete first, so this is the innermost
culprit); its fp32 value is recomputed from the same inputs, positional and keyword (one module
call). Backward: the first module, in backward order, whose output gradient is finite and whose
input gradient is not (full backward hooks); if no activation gradient overflows, the first
module owning a non-finite parameter gradient.

**Underflow damage** per layer (``strategies.model_layers.layers``) of the unscaled mixed
gradient ``g`` against ``r``: ``lost = #{r != 0, g == 0} / #{r != 0}`` and
``cosine = <g, r> / (||g|| ||r||)`` — the same definitions as the app's fidelity probe.

**Decision list** (the first check that holds is the cause; the data is
:data:`strategies.doctor.decide.DECISIONS`, and this list is rendered from it):

{decision_list}

Sources: the T5 fp16 forward overflow (the FFN output ``wo`` exceeds 65504; HF transformers
issue #9295 and ``_keep_in_fp32_modules``), attention-logit growth (Wortsman et al. 2023,
"Small-scale proxies for large-scale Transformer training instabilities": QK-layernorm),
HF's ``DebugUnderflowOverflow`` (forward hooks, first module with inf/nan), and the loss-scaling
recipe of Micikevicius et al. 2018.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from strategies.doctor.decide import DECISIONS, Decision, decide, decision_list
from strategies.doctor.measure import DTYPES, LossFn, measure
from strategies.doctor.verdict import CAUSES, EXIT_CODES, Diagnosis, LayerDamage
from strategies.state import ScaleFloorError

__all__ = ["CAUSES", "DECISIONS", "DEFAULT_SCALE", "DTYPES", "Decision", "Diagnosis", "EXIT_CODES", "LayerDamage",
           "LossFn", "decision_list", "diagnose"]

if __doc__:  # the decision list is written once, as data (None under python -OO)
    __doc__ = __doc__.replace("{decision_list}", decision_list())

DEFAULT_SCALE = 2.0**16


def _current_scale(scaler: Any) -> float:
    """The scaler's scale; a strategy that stopped at its floor (``on_min_scale: raise``) raises
    from ``get_scale()``, and its scale is then the floor it stopped at."""
    try:
        return float(scaler.get_scale())
    except ScaleFloorError:
        return float(scaler.output_scale())


def diagnose(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    precision: str = "fp16",
    scaler: Any = None,
    *,
    scale: float | None = None,
    lr_history: Sequence[float] | None = None,
    compare_strategies: bool = True,
    strategy_names: Sequence[str] | None = None,
    forward_strategies: bool = False,
    underflow_threshold: float = 0.01,
    device_type: str | None = None,
) -> Diagnosis:
    """Diagnose one step of ``model`` on ``batch`` (see the module docstring for the method).

    Args:
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (runs the forward).
        precision: ``"fp16"`` or ``"bf16"`` (``torch.autocast``).
        scaler: a ``GradScaler``-like object; its ``get_scale()`` is the current scale ``S``.
        scale: ``S`` when no scaler is given (default 2^16, GradScaler's initial scale).
        lr_history: learning rates of the recent steps, the current one last (for ``lr_spike``).
        compare_strategies: also measure the scale each registered strategy would choose.
        strategy_names: which strategies to compare (default: every registered one).
        forward_strategies: also compare the strategies that hook the forward pass (``layerwise``,
            ``underflow_target``): one more forward+backward each.
        underflow_threshold: lost fraction of a layer's nonzero entries that counts as damage.
    """
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    if not 0.0 < underflow_threshold < 1.0:
        raise ValueError(f"underflow_threshold must be in (0, 1), got {underflow_threshold}")
    S = _current_scale(scaler) if scaler is not None else float(scale if scale is not None else DEFAULT_SCALE)
    if not (math.isfinite(S) and S > 0):
        raise ValueError(f"scale must be finite and > 0, got {S}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameter that requires grad")
    m = measure(model, loss_fn, batch, params, precision, S, device_type or params[0].device.type,
                compare_strategies, strategy_names, forward_strategies)
    return decide(m, model, params, lr_history, underflow_threshold)
