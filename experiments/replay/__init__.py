"""The replay's app side: ``scalelab-replay`` (:mod:`experiments.replay.cli`), presets resolved
through the config tree (:mod:`experiments.replay.presets`), the replays written into a failed
run's record (:mod:`experiments.replay.record`) and the check against real runs
(:mod:`experiments.replay.check`, ``make replay-check``)."""

__all__: list[str] = []
