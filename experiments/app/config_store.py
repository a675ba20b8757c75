"""The schema node the config tree is composed onto, stored in Hydra's ConfigStore.

``scalelab_schema/run``: every run option (``seed``, ``device``, ``threads``, ``sweep``, ``tags``,
``train.*``, ``regime.*``) with its default, from :class:`experiments.app.config.RunConfig`;
``conf/config.yaml`` merges it first (``- scalelab_schema/run@_here_``), so each default has one
home (the dataclass) and every option is overridable on the command line without ``+``. The node
is a plain mapping, not a structured config: a value of the wrong type composes and is refused by
the dataclass that reads it, in one line (``train.steps must be an integer >= 1, got 'x'``), as before.

:func:`store` runs wherever Hydra composes a config — ``scalelab-train``, the compose API, sweeps
and their launchers' jobs — because Hydra calls the search-path plugin
:class:`hydra_plugins.scalelab_schema.ScalelabSchemas` each time it builds a config search path.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from experiments.app.config import RunConfig
from strategies.params import defaults

__all__ = ["SCHEMA", "store"]

SCHEMA = "scalelab_schema"
"""The config group (in Hydra's ConfigStore) that holds the schema nodes."""


def store() -> None:
    """Store ``scalelab_schema/run``."""
    ConfigStore.instance().store(group=SCHEMA, name="run", node=defaults(RunConfig), provider="scalelab")
