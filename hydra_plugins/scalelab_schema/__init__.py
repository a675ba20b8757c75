"""Hydra plugin: scalelab's schema nodes (:mod:`experiments.app.config_store`) in Hydra's ConfigStore
before any config is composed.

Hydra builds a config search path — and calls every ``SearchPathPlugin`` on it — whenever it
composes: ``@hydra.main`` (``scalelab-train``), the compose API (``initialize_config_dir``, the tests,
``experiments.app.train.preflight``), and a sweep's master, whose ConfigStore travels to the joblib and
submitit jobs with Hydra's other singletons. So this is the one place the schemas are registered;
the search path itself is left as it is.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from experiments.app import config_store

__all__ = ["ScalelabSchemas"]


class ScalelabSchemas(SearchPathPlugin):
    """Stores the schema nodes (:func:`experiments.app.config_store.store`) each time Hydra builds a search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        config_store.store()
