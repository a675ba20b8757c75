"""Binding a rule's update op by name: the twin's signature is the argument list, written once.

A rule's update op ``torch.ops.scalelab.<op>`` and its Python twin take the same positional
arguments (``cuda/ops.cpp`` declares the schema, ``strategies/rules/<rule>.py`` the twin). Instead of
writing that list again at every call, :meth:`strategies.base.Strategy.run_update` (:func:`run`) binds each
parameter of the twin's signature, in its order, from one of three sources:

1. the rule's **state** tensors (``strategy.state.<name>``) — every declared state except
   ``found_inf``, the base's record of the last step: in every op ``found_inf`` is the step's
   flag, which the caller passes (so forgetting it is an error, not last step's flag);
2. its **params** (a field of its ``Params`` dataclass, e.g. ``growth_factor``);
3. the **inputs** the caller passes for this call (statistics such as ``grad_absmax``, values
   derived per step such as ``grow_on_zero``, or a state under the twin's own name such as
   layerwise's ``scales=s.scale``). An input takes the place of a state or field of the same
   name: that is how a rule passes a derived value (layerwise's power-of-two ``min_scale``).

A name found in both the state and the params is ambiguous, a name found nowhere is missing, an
input the twin does not take is unknown: each is a ``TypeError`` naming the op and the argument.
A state the rule declares but that is absent for these params (``State(..., when=...)``, e.g.
``fault``) binds ``None`` where the twin's default is ``None``.

When the extension is loaded, the op's schema must name the same arguments in the same order
as the twin (checked once per op, at its first bind): otherwise a ``RuntimeError`` says which.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any, Callable, Sequence

import torch

from strategies import kernels

__all__ = ["INPUT", "NONE", "PARAM", "STATE", "Slot", "bind", "bind_plan", "check_schema", "run", "twin_names"]

STATE, PARAM, INPUT, NONE = 0, 1, 2, 3
"""Where a slot's value comes from: a state tensor, a params field, a per-call input, None."""

Slot = tuple[int, str]

UNBOUND_STATE = ("found_inf",)
"""Base state never bound by name (the op's ``found_inf`` is the step's flag, passed per call)."""

_CHECKED: set[tuple[str, Callable[..., Any]]] = set()


def twin_names(twin: Callable[..., Any]) -> list[str]:
    """The twin's parameter names, in order (the op's argument list)."""
    return list(inspect.signature(twin).parameters)


def check_schema(op: str, twin: Callable[..., Any]) -> None:
    """Raise ``RuntimeError`` if ``torch.ops.scalelab.<op>``'s schema does not name the twin's
    parameters in the twin's order (checked once per op and twin; nothing to check without the extension)."""
    if (op, twin) in _CHECKED or not (kernels.available() and hasattr(torch.ops.scalelab, op)):
        return
    schema = [a.name for a in getattr(torch.ops.scalelab, op).default._schema.arguments]
    names = twin_names(twin)
    if schema != names:
        raise RuntimeError(f"scalelab::{op}: the op's schema arguments {schema} differ from its twin "
                           f"{twin.__module__}.{twin.__qualname__}{names}: names and order must agree "
                           "(cuda/ops.cpp and the twin's signature; rebuild the extension after changing them)")
    _CHECKED.add((op, twin))


def bind_plan(op: str, twin: Callable[..., Any], state_names: Sequence[str], declared_state: Sequence[str],
              params: Any, inputs: Sequence[str]) -> tuple[Slot, ...]:
    """Where each argument of ``op`` comes from, in the twin's order (see the module docstring).

    Args:
        state_names: the live state tensors' names (``RuleState.specs``).
        declared_state: every state the rule declares, present or not for these params.
        params: the rule's ``Params`` instance (its dataclass fields are bindable).
        inputs: the names the caller passes for this call.
    """
    check_schema(op, twin)
    sig = inspect.signature(twin).parameters
    unknown = [n for n in inputs if n not in sig]
    if unknown:
        raise TypeError(f"scalelab::{op}: input {unknown[0]!r} is not an argument of {twin.__qualname__}"
                        f"{list(sig)}")
    state = set(state_names) - set(UNBOUND_STATE)
    fields = {f.name for f in dataclasses.fields(params)}
    plan: list[Slot] = []
    for name, p in sig.items():
        if name in inputs:
            plan.append((INPUT, name))
        elif name in state and name in fields:
            raise TypeError(f"scalelab::{op}: argument {name!r} is both a state tensor and a params field of "
                            f"{type(params).__name__}: pass it explicitly ({name}=...)")
        elif name in state:
            plan.append((STATE, name))
        elif name in fields:
            plan.append((PARAM, name))
        elif name in declared_state and p.default is None:
            plan.append((NONE, name))
        else:
            raise TypeError(f"scalelab::{op}: argument {name!r} is neither a state tensor, a field of "
                            f"{type(params).__name__} nor a passed input: pass it ({name}=...)")
    return tuple(plan)


def bind(op: str, twin: Callable[..., Any], state: Any, params: Any, declared_state: Sequence[str],
         inputs: tuple[str, ...]) -> tuple[Any, Any, tuple[str, ...], list[Any], Callable[[list[Any]], tuple]]:
    """``(state, params, inputs, values, pick)``, what :meth:`strategies.base.Strategy.run_update`
    caches: ``values`` holds the bound state tensors and params fields in the twin's order (None
    where an input goes), and ``pick(values + [input values in the order of inputs])`` is the
    argument tuple (one ``operator.itemgetter``: no Python loop per step)."""
    plan = bind_plan(op, twin, list(state.specs), declared_state, params, inputs)
    values = [getattr(state, n) if k == STATE else getattr(params, n) if k == PARAM else None for k, n in plan]
    order = [len(plan) + inputs.index(n) if k == INPUT else i for i, (k, n) in enumerate(plan)]
    return state, params, inputs, values, operator.itemgetter(*order)


def run(cache: dict[str, tuple[Any, ...]], op: str, twin: Callable[..., Any], state: Any, params: Any,
        state_spec: Sequence[Any], inputs: dict[str, Any]) -> None:
    """Run ``op`` (or its ``twin``, :func:`strategies.kernels.dispatch`) with its arguments bound by
    name. The :func:`bind` result is kept in ``cache`` per op while ``state``, ``params`` and the
    input names are the same objects (state tensors are updated in place, params replaced whole),
    so a step only fills in the inputs. ``state_spec``: every state the rule declares."""
    names = tuple(inputs)
    bound = cache.get(op)
    if bound is None or bound[0] is not state or bound[1] is not params or bound[2] != names:
        bound = cache[op] = bind(op, twin, state, params, [s.name for s in state_spec], names)
    kernels.dispatch(op, twin, *bound[4]([*bound[3], *inputs.values()]))
