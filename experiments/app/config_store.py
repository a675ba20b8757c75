"""The schema nodes the config tree is composed onto, stored in Hydra's ConfigStore.

* ``scalelab_schema/run``: every run option (``seed``, ``device``, ``threads``, ``sweep``, ``tags``,
  ``train.*``, ``regime.*``) with its default, from :class:`experiments.app.config.RunConfig`;
  ``conf/config.yaml`` merges it first (``- scalelab_schema/run@_here_``).
* ``scalelab_schema/strategy/<name>``, one per registered strategy (built-in, added as one file of
  ``strategies/rules/``, or from an entry-point plugin): ``_target_: strategies.create``, ``name``
  and every field of its ``Params`` with its default. A ``conf/strategy/<option>.yaml`` merges its
  rule's node (``defaults: [/scalelab_schema/strategy/<name>@_here_, _self_]``) and states only
  what differs.

So each default has one home (the dataclass) and every key of a group is overridable on the command
line without ``+``. The nodes are plain mappings, not structured configs: a value of the wrong type
composes and is refused by the dataclass that reads it, in one line (``strategy: init_scale must be
a real number, got 'abc'``), as before. They live outside the ``strategy`` group, so
``strategy=glob(*)`` does not list them.

:func:`store` runs wherever Hydra composes a config — ``scalelab-train``, the compose API, sweeps
and their launchers' jobs — because Hydra calls the search-path plugin
:class:`hydra_plugins.scalelab_schema.ScalelabSchemas` each time it builds a config search path; a
strategy registered before that (e.g. a plugin loaded late) gets its node.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

import strategies
from experiments.app.config import RunConfig
from strategies.params import defaults

__all__ = ["SCHEMA", "strategy_node", "store"]

SCHEMA = "scalelab_schema"
"""The config group (in Hydra's ConfigStore) that holds the schema nodes."""


def strategy_node(name: str) -> dict[str, Any]:
    """The config node of the strategy registered as ``name``: its factory, its name, and every field
    of its ``Params`` with its default."""
    return {"_target_": "strategies.create", "name": name, **defaults(strategies.get(name).Params)}


def store() -> None:
    """Store ``scalelab_schema/run`` and ``scalelab_schema/strategy/<name>`` for every registered strategy."""
    cs = ConfigStore.instance()
    cs.store(group=SCHEMA, name="run", node=defaults(RunConfig), provider="scalelab")
    for name in strategies.available():
        cs.store(group=f"{SCHEMA}/strategy", name=name, node=strategy_node(name), provider="scalelab")
