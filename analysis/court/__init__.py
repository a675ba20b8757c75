"""The fp16-RL scaler court (issue 30): its readings from the runs (:mod:`analysis.court.readings`)
and ``docs/court.md`` (:mod:`analysis.court.page`, ``python -m analysis.court RUN_DIR``)."""

__all__: list[str] = []
