"""The Hydra app: ``scalelab-train`` (``train.py``), its typed config, the loop and the step,
the run directory, records, loggers, checkpoints and the distributed set-up.
"""

__all__: list[str] = []
