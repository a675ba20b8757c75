"""``scalelab-train`` with torch's own scaler in the strategy's place: run under torchrun by
``tests/experiments/test_fsdp2_app.py`` as the reference of the app's FSDP2 runs (the same loop,
data, model and sharding; only the scaler differs).

``SCALELAB_TORCH_SCALER=grad`` (``torch.amp.GradScaler``, torch's scaler for FSDP2) or ``sharded``
(``ShardedGradScaler``), built with the configured strategy's ``init_scale``, ``growth_factor``,
``backoff_factor`` and ``growth_interval`` (the ``native`` rule's fields). The scaler gets the two
things the app's records read from a strategy: ``telemetry()`` (its scale) and ``group_names``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from experiments.app import loop, train

__all__ = ["torch_scaler"]


def _recorded(cls: type) -> type:
    class Recorded(cls):  # type: ignore[misc, valid-type]
        group_names = ["all"]

        def telemetry(self) -> dict[str, torch.Tensor]:
            return {} if self._scale is None else {"scale": self._scale.detach().reshape(()).clone()}

    return Recorded


def torch_scaler(cfg: Any) -> torch.amp.GradScaler:
    s = cfg.strategy
    cls = ShardedGradScaler if os.environ.get("SCALELAB_TORCH_SCALER") == "sharded" else torch.amp.GradScaler
    return _recorded(cls)("cpu", init_scale=float(s.init_scale), growth_factor=float(s.growth_factor),
                          backoff_factor=float(s.backoff_factor), growth_interval=int(s.growth_interval))


if __name__ == "__main__":
    loop.build_strategy = torch_scaler
    train.main()
