"""The workloads: models, data, precision modes and the simulated low-precision casts."""

__all__: list[str] = []
