"""The scale each registered strategy would choose from the doctor's step (``compare_strategies``):
each runs its own ``scale``, ``unscale_``, ``step`` and ``update`` on the step's gradient, through
an optimizer whose step changes nothing, so the model and the retained graph stay as they were.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import strategies
from strategies.probe import ReferenceProbe

__all__ = ["hooks_forward", "strategy_scales"]


class _NoStep(torch.optim.Optimizer):
    """An optimizer whose ``step`` changes nothing: strategies drive it as they would any other."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def hooks_forward(strat: Any) -> bool:
    """Does ``strat.attach`` hook the forward pass (layer boundaries: ``layerwise``,
    ``underflow_target``)? The reference-probe rules' ``attach`` only remembers parameters."""
    return type(strat).attach is not strategies.Strategy.attach and not isinstance(strat, ReferenceProbe)


def strategy_scales(names: Sequence[str], loss: torch.Tensor, params: list[torch.nn.Parameter],
                    model: torch.nn.Module, reference: Callable[[], torch.Tensor],
                    fresh: Callable[[], torch.Tensor] | None) -> tuple[dict[str, float], dict[str, str], int]:
    """The scale each strategy chooses after one step on this gradient (its own scale, unscale_,
    step and update; the optimizer's step does nothing, so no parameter moves, nor does its
    version counter: the retained graph stays usable). A strategy that hooks the forward pass
    needs a forward of its own, with it attached: ``fresh()`` (``None``: such strategies are not
    compared). Returns the scales, the strategies not compared (why), and the fresh forwards run."""
    chosen: dict[str, float] = {}
    skipped: dict[str, str] = {}
    forwards = 0
    for name in names:
        strat = strategies.create(name)
        hooks = hooks_forward(strat)
        if hooks and fresh is None:
            skipped[name] = "hooks the forward pass: compared with forward_strategies=True (one more forward each)"
            continue
        strat.set_reference(reference, params)
        strat.attach(model)
        saved = [p.grad for p in params]
        try:
            own = loss
            if hooks:
                own = fresh()
                forwards += 1
            grads = torch.autograd.grad(strat.scale(own), params, retain_graph=True, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.to(p.dtype)
            strat.step(_NoStep(params))
            strat.update()
            chosen[name] = float(strat.get_scale())
        except (RuntimeError, ValueError) as exc:
            skipped[name] = " ".join(str(exc).split())[:160]
        finally:
            strat.detach()
            for p, g in zip(params, saved):
                p.grad = g
    return chosen, skipped, forwards
