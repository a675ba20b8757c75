"""scalelab experiments: the Hydra training app (``scalelab-train``), its workloads, precision
modes, run records and checkpoints. Importing this package imports nothing heavy; each module is
plain code in the nanoGPT style (see ``experiments/app/train.py`` for the entry point).
"""

__all__: list[str] = []
