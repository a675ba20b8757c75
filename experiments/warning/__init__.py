"""The early warning's labelled evaluation (``make warning-eval``): runs that fail by construction
and their healthy twins (:mod:`experiments.warning.data`), the fit and the held-out evaluation
(:mod:`experiments.warning.evaluate`), ``docs/early-warning.md`` (:mod:`experiments.warning.page`)."""

__all__: list[str] = []
