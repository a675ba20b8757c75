"""The early warning in any training loop: :class:`Watch` (plain loops), the Lightning and Hugging
Face callbacks (:mod:`strategies.watch.lightning`, :mod:`strategies.watch.hf`; each imports its
framework only when called), and the detector itself (:mod:`strategies.watch.detector`).
``import strategies.watch`` loads the doctor's library, which the warning calls when it fires."""

from __future__ import annotations

from strategies.watch.detector import Detector, Observation, observations
from strategies.watch.hf import hf_callback
from strategies.watch.lightning import lightning_callback
from strategies.watch.watch import Watch

__all__ = ["Detector", "Observation", "Watch", "hf_callback", "lightning_callback", "observations"]
