"""Scaled backwards: the backward passes whose loss went through one strategy's ``scale()``.

A strategy's boundary transforms (:mod:`strategies.boundaries`) must act only on a backward
whose loss went through *its* ``scale()``: ``mark`` tags the scaled loss, whose tensor
hook records the running autograd graph task; ``active()`` asks, from a boundary hook, whether
the running task is one of those. Any other backward (a plain ``loss.backward()`` for logging,
an fp32 reference) passes the boundaries untouched. Reentrant backwards (reentrant activation
checkpointing) run as tasks of their own and are not seen as scaled.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["ScaledBackwards"]


class ScaledBackwards:
    """The autograd graph tasks (backward passes) whose root went through one strategy's
    ``scale()`` (module docstring). ``torch._C._current_graph_task_id`` is the id torch's own
    ``torch.utils.checkpoint`` uses for the same question."""

    def __init__(self) -> None:
        self._tasks: set[int] = set()

    def mark(self, outputs: Any) -> Any:
        """Tag the scaled tensors in ``outputs`` (a tensor, or nested lists/tuples/iterables of
        them, as ``scale()`` returns) and return it unchanged (lazily for other iterables)."""
        if isinstance(outputs, torch.Tensor):
            if outputs.requires_grad:
                outputs.register_hook(self._arm)
        elif isinstance(outputs, (list, tuple)):
            for o in outputs:
                self.mark(o)
        elif isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self.mark, outputs)
        return outputs

    def _arm(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._tasks.discard(task))

    def active(self) -> bool:
        """True inside a backward whose root went through :meth:`mark`."""
        return torch._C._current_graph_task_id() in self._tasks
